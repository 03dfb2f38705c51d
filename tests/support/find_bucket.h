// The report's bucket named `name`, for tests that assert one bucket's
// bytes (audit_test.cpp, audit_trainers_test.cpp), and the bytes of all its
// buckets of one category. A missing bucket fails
// the test and gives a bucket of -1 bytes, which no assertion accepts.
#pragma once

#include <cstdint>
#include <string>

#include <gtest/gtest.h>

#include "trainmem/report.h"

namespace trainmem::testing {

inline BucketBytes find_bucket(const AuditReport& report, const std::string& name) {
  for (const auto& b : report.buckets) {
    if (b.name == name) {
      return b;
    }
  }
  ADD_FAILURE() << "no bucket named '" << name << "' in the report";
  BucketBytes missing;
  missing.name = name;
  missing.bytes = -1;
  return missing;
}

inline int64_t bucket_bytes_of(const AuditReport& report, Category category) {
  int64_t bytes = 0;
  for (const auto& b : report.buckets) {
    bytes += b.category == category ? b.bytes : 0;
  }
  return bytes;
}

} // namespace trainmem::testing

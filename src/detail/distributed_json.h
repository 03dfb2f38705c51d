#pragma once
// One rank's report as the JSON each rank sends to rank 0 in
// DistributedAudit::gather() (distributed.cpp) and the writers read back
// (distributed_report.cpp). Never installed.

#include <string>

#include "trainmem/distributed.h"

namespace trainmem::detail {

std::string rank_report_to_json(const RankReport& rank);
RankReport rank_report_from_json(const std::string& json);

} // namespace trainmem::detail

#pragma once
// One rank's report as the JSON each rank sends to rank 0 in
// DistributedAudit::gather() (distributed.cpp) and the writers read back
// (distributed_report.cpp). Never installed.

#include <string>

#include <nlohmann/json.hpp>

#include "trainmem/distributed.h"

namespace trainmem {

// Note [One JSON serializer per report type] (src/audit/detail/report_json.h): found by
// ADL; a rank's AuditReport is a JSON value inside, never a string.
void to_json(nlohmann::ordered_json& j, const RankReport& rank);
void from_json(const nlohmann::ordered_json& j, RankReport& rank);
void to_json(nlohmann::ordered_json& j, const DistributedReport& report);
void from_json(const nlohmann::ordered_json& j, DistributedReport& report);

} // namespace trainmem

namespace trainmem::detail {

std::string rank_report_to_json(const RankReport& rank);
RankReport rank_report_from_json(const std::string& json);

} // namespace trainmem::detail

#pragma once
// The JSON of each report type, one writer and one reader per type (never
// installed): nlohmann_json's to_json / from_json, found by ADL, so
// `Json j = report;` writes and `j.get<AuditReport>()` reads.
//
// Note [One JSON serializer per report type]
// report.h's to_json() / report_from_json() and distributed.h's are the text
// ends of these: they dump or parse (bounded, Note [Reading a report is
// reading hostile input]) and call them. A report inside another (each
// rank's AuditReport inside a RankReport, inside a DistributedReport) is a
// JSON value of its parent, written and read by the same functions, never
// dumped to a string and parsed again. Key order is the writer's order
// (ordered_json): it is the schema's documented order (docs/report.md) and
// the `audit --json` golden holds it byte for byte.
#include <nlohmann/json.hpp>

#include "trainmem/report.h"

namespace trainmem {

void to_json(nlohmann::ordered_json& j, const AuditReport& report);
/// Throws c10::Error ("report_from_json: ...") naming what is wrong.
void from_json(const nlohmann::ordered_json& j, AuditReport& report);

namespace detail {
/// to_chrome_trace()'s document as JSON, for the distributed trace to merge
/// each rank's events without parsing them back.
nlohmann::ordered_json chrome_trace_json(const AuditReport& report);
} // namespace detail

} // namespace trainmem

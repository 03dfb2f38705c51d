// The multi-rank report's summary and writers (distributed.h). Each rank's
// own report is a "trainmem/1" AuditReport: its JSON and Chrome trace come
// from report.h's writers, so one schema describes a rank everywhere.

#include <algorithm>
#include <cstring>

#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "trainmem/distributed.h"

#include "detail/bounded_json.h"
#include "audit/detail/distributed_json.h"
#include "audit/detail/report_json.h"
#include "detail/text.h"

namespace trainmem {
namespace detail {
// A rank report is an audit report (32 deep at most) inside a rank object.
constexpr int kMaxRankReportDepth = 40;
} // namespace detail
namespace {

using Json = nlohmann::ordered_json;

// The phase of the highest peak of the rank's steps.
std::string peak_phase(const AuditReport& r) {
  const StepRecord* worst = nullptr;
  for (const auto& s : r.steps) {
    if (worst == nullptr || s.peak_bytes > worst->peak_bytes) {
      worst = &s;
    }
  }
  if (worst == nullptr) {
    return "-";
  }
  Phase p = Phase::kForward;
  int64_t b = worst->forward_peak_bytes;
  if (worst->backward_peak_bytes > b) {
    p = Phase::kBackward;
    b = worst->backward_peak_bytes;
  }
  if (worst->optimizer_peak_bytes > b) {
    p = Phase::kOptimizerStep;
  }
  return fmt::format("step {} {}", worst->step, phase_name(p));
}

double last_step_ms(const AuditReport& r) {
  return r.steps.empty() ? 0.0 : r.steps.back().time_ms;
}

} // namespace

namespace detail {

std::string rank_report_to_json(const RankReport& rank) {
  return Json(rank).dump();
}

RankReport rank_report_from_json(const std::string& text) {
  return parse_bounded_json<Json>(text, kMaxRankReportDepth, "rank report").get<RankReport>();
}

} // namespace detail

// Note [One JSON serializer per report type] (src/audit/detail/report_json.h).
void to_json(Json& j, const RankReport& r) {
  j = Json{{"rank", r.rank},
           {"communication_bytes", r.communication_bytes},
           {"bucket_bytes", r.bucket_bytes},
           {"origin_ns", r.origin_ns},
           {"report", r.audit}};
}

void from_json(const Json& j, RankReport& r) {
  r = RankReport{};
  try {
    r.rank = j.at("rank").get<int64_t>();
    r.communication_bytes = j.at("communication_bytes").get<int64_t>();
    r.bucket_bytes = j.at("bucket_bytes").get<std::vector<int64_t>>();
    r.origin_ns = j.at("origin_ns").get<int64_t>();
    r.audit = j.at("report").get<AuditReport>();
  } catch (const Json::exception& e) {
    TORCH_CHECK(false, "distributed_report_from_json: a rank entry: ", e.what());
  }
}

int64_t DistributedReport::worst_rank() const {
  int64_t worst = -1, peak = -1;
  for (const auto& r : ranks) {
    if (r.audit.peak_bytes > peak) {
      peak = r.audit.peak_bytes;
      worst = r.rank;
    }
  }
  return worst;
}

int64_t DistributedReport::max_peak_bytes() const {
  int64_t m = 0;
  for (const auto& r : ranks) {
    m = std::max(m, r.audit.peak_bytes);
  }
  return m;
}

int64_t DistributedReport::min_peak_bytes() const {
  if (ranks.empty()) {
    return 0;
  }
  int64_t m = ranks.front().audit.peak_bytes;
  for (const auto& r : ranks) {
    m = std::min(m, r.audit.peak_bytes);
  }
  return m;
}

double DistributedReport::peak_imbalance() const {
  if (ranks.empty()) {
    return 0.0;
  }
  double sum = 0;
  for (const auto& r : ranks) {
    sum += static_cast<double>(r.audit.peak_bytes);
  }
  const double mean = sum / static_cast<double>(ranks.size());
  return mean > 0 ? static_cast<double>(max_peak_bytes()) / mean : 0.0;
}

std::string to_text(const DistributedReport& r) {
  std::string out = fmt::format("{}: {} ranks ({}), data-parallel\n", r.title, r.world_size, r.backend);
  if (!r.config.empty()) {
    std::string line;
    for (const auto& [k, v] : r.config) {
      line += fmt::format("{}{}={}", line.empty() ? "" : " ", k, v);
    }
    out += "  " + line + "\n";
  }
  out += fmt::format("\n{:<5} {:>16} {:>16} {:>16} {:>16}  {:<22} {:>12}\n", "rank", "static B", "comm buffers B",
                     "saved B", "peak B", "peak phase", "last step ms");
  for (const auto& k : r.ranks) {
    out += fmt::format("{:<5} {:>16} {:>16} {:>16} {:>16}  {:<22} {:>12.1f}\n", k.rank,
                       with_commas(k.audit.static_bytes()), with_commas(k.communication_bytes),
                       with_commas(k.audit.saved_activation_bytes), with_commas(k.audit.peak_bytes),
                       peak_phase(k.audit), last_step_ms(k.audit));
  }
  if (!r.ranks.empty()) {
    out += fmt::format("peak: max {} B, min {} B, imbalance (max / mean) {:.3f}; worst rank {}\n",
                       with_commas(r.max_peak_bytes()), with_commas(r.min_peak_bytes()), r.peak_imbalance(),
                       r.worst_rank());
  }
  if (r.predicted_static_per_rank_bytes >= 0 && !r.ranks.empty()) {
    const auto& w = r.ranks[static_cast<size_t>(std::max<int64_t>(r.worst_rank(), 0))];
    out += "\nstatic bytes per rank, predicted (accountant, ZeRO-0) beside measured\n";
    out += fmt::format("  {:<44} {:>16} B\n", "predicted, ZeRO-0 (every rank holds all)",
                       with_commas(r.predicted_static_per_rank_bytes));
    out += fmt::format("  {:<44} {:>16} B\n", fmt::format("measured static buckets, rank {}", w.rank),
                       with_commas(w.audit.static_bytes()));
    out += fmt::format("  {:<44} {:>16} B\n", fmt::format("communication buffers (DDP buckets), rank {}", w.rank),
                       with_commas(w.communication_bytes));
    out += fmt::format("  {:<44} {:>16} B\n", "measured static + communication buffers",
                       with_commas(w.audit.static_bytes() + w.communication_bytes));
    if (!r.prediction.empty()) {
      out += "  " + r.prediction;
      if (r.prediction.back() != '\n') {
        out += "\n";
      }
    }
  }
  if (!r.disagreements.empty()) {
    out += "\nranks that disagree on the model (not averaged):\n";
    for (const auto& d : r.disagreements) {
      out += "  " + d + "\n";
    }
  }
  if (!r.notes.empty()) {
    out += "\nnotes:\n";
    for (const auto& n : r.notes) {
      out += "  - " + n + "\n";
    }
  }
  return out;
}

void to_json(Json& j, const DistributedReport& r) {
  j = Json::object();
  j["schema"] = r.schema;
  j["title"] = r.title;
  j["backend"] = r.backend;
  j["world_size"] = r.world_size;
  Json config = Json::object();
  for (const auto& [k, v] : r.config) {
    config[k] = v;
  }
  j["config"] = config;
  j["predicted_static_per_rank_bytes"] = r.predicted_static_per_rank_bytes;
  j["prediction"] = r.prediction;
  j["summary"] = {{"max_peak_bytes", r.max_peak_bytes()},
                  {"min_peak_bytes", r.min_peak_bytes()},
                  {"peak_imbalance", r.peak_imbalance()},
                  {"worst_rank", r.worst_rank()}};
  j["disagreements"] = r.disagreements;
  j["notes"] = r.notes;
  j["ranks"] = r.ranks;
}

void from_json(const Json& j, DistributedReport& r) {
  TORCH_CHECK(j.is_object(), "distributed_report_from_json: expected a JSON object, but got ", j.type_name());
  r = DistributedReport{};
  TORCH_CHECK(j.contains("schema") && j["schema"].is_string() && j["schema"].get<std::string>() == r.schema,
              "distributed_report_from_json: expected schema \"", r.schema, "\", but got ",
              j.contains("schema") ? j["schema"].dump() : std::string("none"));
  try {
    r.title = j.at("title").get<std::string>();
    r.backend = j.at("backend").get<std::string>();
    r.world_size = j.at("world_size").get<int64_t>();
    for (auto it = j.at("config").begin(); it != j.at("config").end(); ++it) {
      r.config.emplace_back(it.key(), it.value().get<std::string>());
    }
    r.predicted_static_per_rank_bytes = j.at("predicted_static_per_rank_bytes").get<int64_t>();
    r.prediction = j.at("prediction").get<std::string>();
    r.disagreements = j.at("disagreements").get<std::vector<std::string>>();
    r.notes = j.at("notes").get<std::vector<std::string>>();
    for (const auto& k : j.at("ranks")) {
      r.ranks.push_back(k.get<RankReport>());
    }
  } catch (const Json::exception& e) {
    TORCH_CHECK(false, "distributed_report_from_json: ", e.what());
  }
}

std::string to_json(const DistributedReport& r, int indent) {
  return Json(r).dump(indent);
}

DistributedReport distributed_report_from_json(const std::string& text) {
  return detail::parse_bounded_json<Json>(text, detail::kMaxRankReportDepth, "distributed_report_from_json")
      .get<DistributedReport>();
}

std::string to_html(const DistributedReport& r) {
  std::string h =
      "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
      "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; "
      "style-src 'unsafe-inline'; img-src data:\">\n";
  h += fmt::format("<title>trainmem audit: {} ({} ranks)</title>\n", detail::html_escape(r.title), r.world_size);
  h += "<style>body{font:14px sans-serif;margin:24px;color:#222}table{border-collapse:collapse;margin:8px 0 20px}"
       "td,th{border:1px solid #ccc;padding:3px 8px}td.n{text-align:right;font-family:monospace}"
       ".ranks{display:flex;gap:16px;align-items:flex-start;overflow-x:auto}"
       ".rank{border:1px solid #ccc;padding:8px;min-width:280px}.worst{border-color:#e15759}</style>\n"
       "</head>\n<body>\n";
  h += fmt::format("<h1>{}: {} ranks ({})</h1>\n", detail::html_escape(r.title), r.world_size, detail::html_escape(r.backend));
  h += "<table>\n<tr><th>rank</th><th>static B</th><th>comm buffers B</th><th>saved B</th><th>peak B</th>"
       "<th>peak phase</th><th>last step ms</th></tr>\n";
  for (const auto& k : r.ranks) {
    h += fmt::format(
        "<tr><td>{}</td><td class=\"n\">{}</td><td class=\"n\">{}</td><td class=\"n\">{}</td><td class=\"n\">{}</td>"
        "<td>{}</td><td class=\"n\">{:.1f}</td></tr>\n",
        k.rank, with_commas(k.audit.static_bytes()), with_commas(k.communication_bytes),
        with_commas(k.audit.saved_activation_bytes), with_commas(k.audit.peak_bytes), peak_phase(k.audit),
        last_step_ms(k.audit));
  }
  h += "</table>\n";
  h += fmt::format("<p>peak: max {} B, min {} B, imbalance (max / mean) {:.3f}; worst rank {}</p>\n",
                   with_commas(r.max_peak_bytes()), with_commas(r.min_peak_bytes()), r.peak_imbalance(),
                   r.worst_rank());
  if (r.predicted_static_per_rank_bytes >= 0) {
    h += fmt::format("<p>predicted static bytes per rank (accountant, ZeRO-0): {} B</p>\n<pre>{}</pre>\n",
                     with_commas(r.predicted_static_per_rank_bytes), detail::html_escape(r.prediction));
  }
  if (!r.disagreements.empty()) {
    h += "<h2>Ranks that disagree on the model</h2>\n<ul>\n";
    for (const auto& d : r.disagreements) {
      h += "<li>" + detail::html_escape(d) + "</li>\n";
    }
    h += "</ul>\n";
  }
  // The ranks side by side, on one byte scale so their heights compare.
  int64_t ymax = 1;
  for (const auto& k : r.ranks) {
    for (const auto& p : k.audit.series) {
      ymax = std::max(ymax, p.total_bytes());
    }
  }
  const int64_t worst = r.worst_rank();
  h += "<h2>Ranks side by side</h2>\n<div class=\"ranks\">\n";
  for (const auto& k : r.ranks) {
    const auto& a = k.audit;
    h += fmt::format("<div class=\"rank{}\">\n<h3>rank {}{}</h3>\n", k.rank == worst ? " worst" : "", k.rank,
                     k.rank == worst ? " (worst)" : "");
    constexpr double kW = 280, kH = 120;
    if (a.series.size() >= 2) {
      const double t0 = static_cast<double>(a.series.front().time_ns);
      const double t1 = std::max(static_cast<double>(a.series.back().time_ns), t0 + 1);
      std::string pts;
      for (const auto& p : a.series) {
        pts += fmt::format("{:.1f},{:.1f} ", (static_cast<double>(p.time_ns) - t0) / (t1 - t0) * kW,
                           kH - static_cast<double>(p.total_bytes()) / static_cast<double>(ymax) * kH);
      }
      h += fmt::format(
          "<svg width=\"{}\" height=\"{}\" viewBox=\"0 0 {} {}\" role=\"img\" aria-label=\"rank {} live bytes\">"
          "<polyline points=\"{}\" fill=\"none\" stroke=\"#4e79a7\" stroke-width=\"1.5\"/></svg>\n",
          kW, kH, kW, kH, k.rank, pts);
    }
    h += "<table>\n";
    for (const auto& b : a.buckets) {
      h += fmt::format("<tr><td>{}</td><td class=\"n\">{}</td></tr>\n", detail::html_escape(b.name), with_commas(b.bytes));
    }
    h += fmt::format("<tr><td>communication buffers ({} buckets)</td><td class=\"n\">{}</td></tr>\n",
                     k.bucket_bytes.size(), with_commas(k.communication_bytes));
    h += fmt::format("<tr><td>saved for backward</td><td class=\"n\">{}</td></tr>\n",
                     with_commas(a.saved_activation_bytes));
    h += fmt::format("<tr><td>peak ({})</td><td class=\"n\">{}</td></tr>\n", peak_phase(a),
                     with_commas(a.peak_bytes));
    h += "</table>\n</div>\n";
  }
  h += "</div>\n";
  if (!r.notes.empty()) {
    h += "<h2>Notes</h2>\n<ul>\n";
    for (const auto& n : r.notes) {
      h += "<li>" + detail::html_escape(n) + "</li>\n";
    }
    h += "</ul>\n";
  }
  h += "</body>\n</html>\n";
  return h;
}

std::string to_chrome_trace(const DistributedReport& r) {
  // Each rank's own trace, moved to pid = rank and shifted so that all ranks
  // share the earliest rank's time zero.
  int64_t origin = 0;
  for (const auto& k : r.ranks) {
    if (k.origin_ns > 0 && (origin == 0 || k.origin_ns < origin)) {
      origin = k.origin_ns;
    }
  }
  Json events = Json::array();
  for (const auto& k : r.ranks) {
    const double shift_us = k.origin_ns > 0 ? static_cast<double>(k.origin_ns - origin) / 1000.0 : 0.0;
    Json one = detail::chrome_trace_json(k.audit);
    for (auto& e : one.at("traceEvents")) {
      e["pid"] = k.rank;
      if (e.value("name", "") == "process_name") {
        e["args"]["name"] = fmt::format("rank {}", k.rank);
      }
      if (e.contains("ts")) {
        e["ts"] = e["ts"].get<double>() + shift_us;
      }
      events.push_back(std::move(e));
    }
    events.push_back({{"name", "process_sort_index"}, {"ph", "M"}, {"pid", k.rank}, {"tid", 0},
                      {"args", {{"sort_index", k.rank}}}});
  }
  Json j = {{"displayTimeUnit", "ms"}, {"traceEvents", events}};
  return j.dump();
}

} // namespace trainmem

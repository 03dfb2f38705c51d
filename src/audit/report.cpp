#include "trainmem/report.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "detail/bounded_json.h"
#include "audit/detail/report_json.h"

namespace trainmem {
namespace {

using Json = nlohmann::ordered_json;

// Display order (reports, JSON keys): a module's buffers beside its parameters.
constexpr std::array<Category, kNumCategories> kCategories = {
    Category::kParameter, Category::kBuffer, Category::kGradient,  Category::kOptimizerState,
    Category::kActivation, Category::kTemporary, Category::kInput,
    Category::kCommunication, Category::kUnknown, Category::kBeforeAudit};

Category category_from_name(const std::string& name) {
  for (auto c : kCategories) {
    if (name == category_name(c)) {
      return c;
    }
  }
  TORCH_CHECK(false, "report_from_json: unknown category \"", name, "\"");
}

Phase phase_from_name(const std::string& name) {
  for (int i = 0; i < kNumPhases; ++i) {
    if (name == phase_name(static_cast<Phase>(i))) {
      return static_cast<Phase>(i);
    }
  }
  TORCH_CHECK(false, "report_from_json: unknown phase \"", name, "\"");
}

Json category_bytes_json(const CategoryBytes& b) {
  Json j = Json::object();
  for (auto c : kCategories) {
    j[category_name(c)] = b[static_cast<int>(c)];
  }
  return j;
}

// Note [Reading a report is reading hostile input]
// `trainmem report FILE` reads what anyone may have written. Every number is
// checked before use: a whole number (1.5 is not silently truncated), within
// range (1e30 is no UB cast, INT64_MIN reaches no negation), and byte counts
// are >= 0 and at most 4 EiB, so sums over them cannot overflow. The nesting
// depth is bounded before parsing.
constexpr int64_t kMaxReportBytes = int64_t{1} << 62;
constexpr int kMaxReportDepth = 32;

int64_t int_value(const Json& v, const std::string& what, int64_t lo, int64_t hi) {
  bool ok = false;
  int64_t out = 0;
  if (v.is_number_unsigned()) {
    const auto u = v.get<uint64_t>();
    ok = u <= static_cast<uint64_t>(hi) && hi >= 0;
    out = ok ? static_cast<int64_t>(u) : 0;
    ok = ok && out >= lo;
  } else if (v.is_number_integer()) {
    out = v.get<int64_t>();
    ok = out >= lo && out <= hi;
  }
  TORCH_CHECK(ok, "report_from_json: expected ", what, " to be a whole number in [", lo, ", ", hi, "], but got ",
              v.dump());
  return out;
}

// A byte count or a count of things: 0 .. 4 EiB.
int64_t count_at(const Json& obj, const char* key, int64_t lo = 0) {
  return int_value(obj.at(key), std::string("\"") + key + "\"", lo, kMaxReportBytes);
}

double number_at(const Json& obj, const char* key, double lo, double hi) {
  const auto& v = obj.at(key);
  const double d = v.is_number() ? v.get<double>() : std::nan("");
  TORCH_CHECK(v.is_number() && std::isfinite(d) && d >= lo && d <= hi, "report_from_json: expected \"", key,
              "\" to be a number in [", lo, ", ", hi, "], but got ", v.dump());
  return d;
}

CategoryBytes category_bytes_from(const Json& j) {
  CategoryBytes b{};
  TORCH_CHECK(j.is_object(), "report_from_json: expected bytes by category as an object, but got ", j.dump());
  for (auto it = j.begin(); it != j.end(); ++it) {
    b[static_cast<int>(category_from_name(it.key()))] =
        int_value(it.value(), "bytes of " + it.key(), 0, kMaxReportBytes);
  }
  return b;
}

// Text from a report file may hold anything JSON allows; a terminal must
// not receive its control characters (escape sequences). C0, DEL and the C1
// controls (UTF-8 C2 80..C2 9F) are written as \xNN / \u00NN.
std::string printable(const std::string& s) {
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size(); ++i) {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c < 0x20 || c == 0x7f) {
      out += fmt::format("\\x{:02x}", c);
    } else if (c == 0xc2 && i + 1 < s.size() && static_cast<unsigned char>(s[i + 1]) >= 0x80 &&
               static_cast<unsigned char>(s[i + 1]) <= 0x9f) {
      out += fmt::format("\\u00{:02x}", static_cast<unsigned char>(s[i + 1]));
      ++i;
    } else {
      out += s[i];
    }
  }
  return out;
}

std::string pct(int64_t part, int64_t whole) {
  return whole > 0 ? fmt::format("{:.1f} %", 100.0 * static_cast<double>(part) / static_cast<double>(whole))
                   : std::string("-");
}

StepStat stat_of(std::vector<int64_t> v) {
  if (v.empty()) {
    return StepStat{};
  }
  std::sort(v.begin(), v.end());
  return StepStat{v.front(), v[(v.size() - 1) / 2], v.back()};
}

// Steps that hold several backward passes (an update loop inside one
// audited step, accumulation, a GAN): per pass, the peak of its forward and
// backward and what it saved (Note [Steps within a step]).
std::string inner_steps_text(const AuditReport& r) {
  std::string out;
  size_t i = 0;
  while (i < r.phases.size()) {
    const int64_t step = r.phases[i].step;
    std::vector<int64_t> peaks, saved;
    int64_t since_last = 0;  // peak since the last backward ended
    for (; i < r.phases.size() && r.phases[i].step == step; ++i) {
      const auto& p = r.phases[i];
      since_last = std::max(since_last, p.peak_bytes);
      if (p.phase == Phase::kBackward) {
        peaks.push_back(since_last);
        since_last = 0;
        if (p.saved_bytes >= 0) {
          saved.push_back(p.saved_bytes);
        }
      } else if (p.phase == Phase::kOptimizerStep) {
        since_last = 0;
      }
    }
    if (peaks.size() < 2) {
      continue;
    }
    if (out.empty()) {
      out = "\nsteps within a step: per backward pass, its forward and backward      min / median / max\n";
    }
    const auto pk = stat_of(peaks);
    out += fmt::format("  step {:<6} {} passes, peak {} / {} / {} B\n", step, peaks.size(), with_commas(pk.min),
                       with_commas(pk.median), with_commas(pk.max));
    if (!saved.empty()) {
      const auto sv = stat_of(saved);
      out += fmt::format("  {:<11} {} metered, saved {} / {} / {} B\n", "", saved.size(), with_commas(sv.min),
                         with_commas(sv.median), with_commas(sv.max));
    }
  }
  return out;
}

} // namespace

int64_t AuditReport::static_bytes() const {
  int64_t sum = 0;
  for (const auto& b : buckets) {
    sum += b.bytes;
  }
  return sum;
}

// ---- text -------------------------------------------------------------------

StepSummary summarize_steps(const std::vector<StepRecord>& steps) {
  TORCH_CHECK(!steps.empty(), "summarize_steps: no steps to summarize");
  auto stat = [&](auto get, bool metered_only = false) {
    std::vector<int64_t> v;
    v.reserve(steps.size());
    for (const auto& s : steps) {
      if (s.metered || s.repeats >= 0 || !metered_only) {
        v.push_back(get(s));
      }
    }
    return stat_of(std::move(v));
  };
  StepSummary sum;
  sum.num_steps = static_cast<int64_t>(steps.size());
  sum.peak_bytes = stat([](const StepRecord& s) { return s.peak_bytes; });
  sum.forward_peak_bytes = stat([](const StepRecord& s) { return s.forward_peak_bytes; });
  sum.backward_peak_bytes = stat([](const StepRecord& s) { return s.backward_peak_bytes; });
  sum.optimizer_peak_bytes = stat([](const StepRecord& s) { return s.optimizer_peak_bytes; });
  sum.saved_activation_bytes = stat([](const StepRecord& s) { return s.saved_activation_bytes; }, true);
  sum.time_us = stat([](const StepRecord& s) { return static_cast<int64_t>(std::llround(s.time_ms * 1000.0)); });
  return sum;
}

std::string to_text(const AuditReport& r) {
  std::string out = fmt::format("trainmem audit: {} on {}\n", printable(r.title), printable(r.device));
  if (!r.config.empty()) {
    std::string line;
    for (const auto& [k, v] : r.config) {
      line += fmt::format("{}{}={}", line.empty() ? "" : " ", printable(k), printable(v));
    }
    out += "  " + line + "\n";
  }
  out += fmt::format("\nstatic buckets ({} parameters)\n", with_commas(r.num_params));
  for (const auto& b : r.buckets) {
    out += fmt::format("  {:<36} {:>16} B  {:>10}\n", printable(b.name), with_commas(b.bytes), human_bytes(b.bytes));
  }
  out += fmt::format("  {:<36} {:>16} B  {:>10}\n", "total", with_commas(r.static_bytes()),
                     human_bytes(r.static_bytes()));
  out += fmt::format("\nsaved for backward   {:>16} B  {:>10}\n", with_commas(r.saved_activation_bytes),
                     human_bytes(r.saved_activation_bytes));
  if (r.predicted_activation_bytes > 0) {
    out += fmt::format("predicted            {:>16} B  (measured / predicted {:.3f})\n",
                       with_commas(r.predicted_activation_bytes),
                       static_cast<double>(r.saved_activation_bytes) /
                           static_cast<double>(r.predicted_activation_bytes));
  }
  // The largest nodes, and one row for the rest, so that the rows sum to the total.
  const size_t top = std::min<size_t>(r.saved_by_node.size(), kMaxNodeRows);
  for (size_t i = 0; i < top; ++i) {
    const auto& n = r.saved_by_node[i];
    out += fmt::format("  {:<46} {:>16} B  {:>8}\n", printable(n.node), with_commas(n.bytes),
                       pct(n.bytes, r.saved_activation_bytes));
  }
  if (r.saved_by_node.size() > top) {
    int64_t rest = 0;
    for (size_t i = top; i < r.saved_by_node.size(); ++i) {
      rest += r.saved_by_node[i].bytes;
    }
    out += fmt::format("  {:<46} {:>16} B  {:>8}\n", fmt::format("other ({} nodes)", r.saved_by_node.size() - top),
                       with_commas(rest), pct(rest, r.saved_activation_bytes));
  }
  if (r.saved_activation_bytes > 0) {
    out += fmt::format("  where: {} B on the device, {} B offloaded to the host\n",
                       with_commas(r.saved_device_bytes), with_commas(r.saved_host_bytes));
  }
  if (!r.steps.empty()) {
    out += "\nsteps          time ms      peak B               forward peak B      backward peak B     optimizer peak B\n";
    const bool summarize = static_cast<int64_t>(r.steps.size()) > kMaxStepRows;
    const size_t rows = summarize ? 3 : r.steps.size();
    for (size_t i = 0; i < rows; ++i) {
      const auto& s = r.steps[i];
      out += fmt::format("  {:<8} {:>10.1f}   {:>18}   {:>18}   {:>18}   {:>18}\n", s.step, s.time_ms,
                         with_commas(s.peak_bytes), with_commas(s.forward_peak_bytes),
                         with_commas(s.backward_peak_bytes), with_commas(s.optimizer_peak_bytes));
    }
    if (summarize) {
      const auto sum = summarize_steps(r.steps);
      out += fmt::format("  ... {} steps in all:\n", sum.num_steps);
      const std::pair<const char*, int64_t StepStat::*> rows3[] = {
          {"min", &StepStat::min}, {"median", &StepStat::median}, {"max", &StepStat::max}};
      for (const auto& [label, field] : rows3) {
        out += fmt::format("  {:<8} {:>10.1f}   {:>18}   {:>18}   {:>18}   {:>18}\n", label,
                           static_cast<double>(sum.time_us.*field) / 1000.0, with_commas(sum.peak_bytes.*field),
                           with_commas(sum.forward_peak_bytes.*field), with_commas(sum.backward_peak_bytes.*field),
                           with_commas(sum.optimizer_peak_bytes.*field));
      }
    }
    out += fmt::format("peak over steps      {:>16} B  {:>10}\n", with_commas(r.peak_bytes), human_bytes(r.peak_bytes));
  }
  out += inner_steps_text(r);
  int64_t at_peak = 0;
  for (auto b : r.peak_by_category) {
    at_peak += b;
  }
  if (at_peak > 0) {
    out += "live at the peak, by category\n";
    for (auto c : kCategories) {
      const int64_t b = r.peak_by_category[static_cast<int>(c)];
      if (b != 0) {
        out += fmt::format("  {:<36} {:>16} B  {:>8}\n", category_name(c), with_commas(b), pct(b, at_peak));
      }
    }
  }
  const auto& d = r.device_stats;
  out += fmt::format("\ndevice {}: allocated {} B (peak {}), reserved {} B (peak {})\n", printable(d.device),
                     with_commas(d.allocated_bytes), with_commas(d.peak_allocated_bytes),
                     with_commas(d.reserved_bytes), with_commas(d.peak_reserved_bytes));
  if (d.num_alloc_retries > 0 || d.num_ooms > 0) {
    out += fmt::format("  allocation retries {}, OOMs {}\n", d.num_alloc_retries, d.num_ooms);
  }
  out += fmt::format("fragmentation: slack {} B, inactive split {} B\n", with_commas(r.fragmentation.slack_bytes),
                     with_commas(r.fragmentation.inactive_split_bytes));
  for (const auto& h : r.fragmentation.hints) {
    out += "  hint: " + printable(h) + "\n";
  }
  for (const auto& n : r.notes) {
    out += "note: " + printable(n) + "\n";
  }
  return out;
}

// ---- JSON -------------------------------------------------------------------

// Note [One JSON serializer per report type] (src/audit/detail/report_json.h).
void to_json(Json& j, const AuditReport& r) {
  j = Json::object();
  j["schema"] = r.schema;
  j["title"] = r.title;
  Json config = Json::object();
  for (const auto& [k, v] : r.config) {
    config[k] = v;
  }
  j["config"] = config;
  j["device"] = r.device;
  j["num_params"] = r.num_params;
  Json buckets = Json::array();
  for (const auto& b : r.buckets) {
    buckets.push_back({{"name", b.name}, {"category", category_name(b.category)}, {"bytes", b.bytes}});
  }
  j["buckets"] = buckets;
  j["static_bytes"] = r.static_bytes();
  j["saved_activation_bytes"] = r.saved_activation_bytes;
  j["saved_device_bytes"] = r.saved_device_bytes;
  j["saved_host_bytes"] = r.saved_host_bytes;
  Json nodes = Json::array();
  for (const auto& n : r.saved_by_node) {
    nodes.push_back({{"node", n.node}, {"bytes", n.bytes}, {"num_tensors", n.num_tensors}});
  }
  j["saved_by_node"] = nodes;
  j["predicted_activation_bytes"] = r.predicted_activation_bytes;
  Json steps = Json::array();
  for (const auto& s : r.steps) {
    steps.push_back({{"step", s.step},
                     {"time_ms", s.time_ms},
                     {"peak_bytes", s.peak_bytes},
                     {"forward_peak_bytes", s.forward_peak_bytes},
                     {"backward_peak_bytes", s.backward_peak_bytes},
                     {"optimizer_peak_bytes", s.optimizer_peak_bytes},
                     {"saved_activation_bytes", s.saved_activation_bytes},
                     {"metered", s.metered},
                     {"repeats", s.repeats}});
  }
  j["steps"] = steps;
  j["peak_bytes"] = r.peak_bytes;
  j["peak_by_category_bytes"] = category_bytes_json(r.peak_by_category);
  const auto& d = r.device_stats;
  j["device_stats"] = {{"device", d.device},
                       {"allocated_bytes", d.allocated_bytes},
                       {"peak_allocated_bytes", d.peak_allocated_bytes},
                       {"reserved_bytes", d.reserved_bytes},
                       {"peak_reserved_bytes", d.peak_reserved_bytes},
                       {"active_bytes", d.active_bytes},
                       {"peak_active_bytes", d.peak_active_bytes},
                       {"inactive_split_bytes", d.inactive_split_bytes},
                       {"peak_inactive_split_bytes", d.peak_inactive_split_bytes},
                       {"requested_bytes", d.requested_bytes},
                       {"num_allocs", d.num_allocs},
                       {"num_frees", d.num_frees},
                       {"num_alloc_retries", d.num_alloc_retries},
                       {"num_ooms", d.num_ooms}};
  j["fragmentation"] = {{"slack_bytes", r.fragmentation.slack_bytes},
                        {"inactive_split_bytes", r.fragmentation.inactive_split_bytes},
                        {"slack_fraction", r.fragmentation.slack_fraction},
                        {"hints", r.fragmentation.hints}};
  Json phases = Json::array();
  for (const auto& p : r.phases) {
    phases.push_back({{"phase", phase_name(p.phase)},
                      {"name", p.name},
                      {"step", p.step},
                      {"begin_ns", p.begin_ns},
                      {"end_ns", p.end_ns},
                      {"peak_bytes", p.peak_bytes},
                      {"peak_by_category_bytes", category_bytes_json(p.peak_by_category)}});
    if (p.saved_bytes >= 0) {
      phases.back()["saved_bytes"] = p.saved_bytes;  // a metered backward's micro-batch
    }
  }
  j["phases"] = phases;
  Json times = Json::array();
  Json by_cat = Json::object();
  for (auto c : kCategories) {
    by_cat[category_name(c)] = Json::array();
  }
  for (const auto& p : r.series) {
    times.push_back(p.time_ns);
    for (auto c : kCategories) {
      by_cat[category_name(c)].push_back(p.bytes[static_cast<int>(c)]);
    }
  }
  j["series"] = {{"time_ns", times}, {"bytes", by_cat}};
  j["notes"] = r.notes;
}

namespace {

// report_from_json's parts: one step's record, the device's statistics, one
// phase span, the thinned series (each throws c10::Error or Json::exception
// on a malformed part).
StepRecord step_from_json(const Json& s) {
  StepRecord rec;
  rec.step = count_at(s, "step");
  rec.time_ms = number_at(s, "time_ms", 0.0, 1e15);
  rec.peak_bytes = count_at(s, "peak_bytes");
  rec.forward_peak_bytes = count_at(s, "forward_peak_bytes");
  rec.backward_peak_bytes = count_at(s, "backward_peak_bytes");
  rec.optimizer_peak_bytes = count_at(s, "optimizer_peak_bytes");
  rec.saved_activation_bytes = count_at(s, "saved_activation_bytes");
  if (s.contains("metered")) {  // reports before AuditOptions::meter_every have none: all metered
    TORCH_CHECK(s["metered"].is_boolean(), "report_from_json: expected \"metered\" of step ", rec.step,
                " to be true or false, but got ", s["metered"].dump());
    rec.metered = s["metered"].get<bool>();
  }
  if (s.contains("repeats")) {  // optional: where absent, none is known
    rec.repeats = int_value(s["repeats"], "\"repeats\" of step " + std::to_string(rec.step), -1,
                            std::max<int64_t>(rec.step - 1, -1));
    TORCH_CHECK(rec.repeats < 0 || !rec.metered, "report_from_json: step ", rec.step,
                " is metered, but \"repeats\" names step ", rec.repeats);
  }
  return rec;
}

DeviceMemoryStats device_stats_from_json(const Json& d) {
  DeviceMemoryStats s;
  s.device = d.at("device").get<std::string>();
  s.allocated_bytes = count_at(d, "allocated_bytes");
  s.peak_allocated_bytes = count_at(d, "peak_allocated_bytes");
  s.reserved_bytes = count_at(d, "reserved_bytes");
  s.peak_reserved_bytes = count_at(d, "peak_reserved_bytes");
  s.active_bytes = count_at(d, "active_bytes");
  s.peak_active_bytes = count_at(d, "peak_active_bytes");
  s.inactive_split_bytes = count_at(d, "inactive_split_bytes");
  s.peak_inactive_split_bytes = count_at(d, "peak_inactive_split_bytes");
  s.requested_bytes = count_at(d, "requested_bytes");
  s.num_allocs = count_at(d, "num_allocs");
  s.num_frees = count_at(d, "num_frees");
  s.num_alloc_retries = count_at(d, "num_alloc_retries");
  s.num_ooms = count_at(d, "num_ooms");
  return s;
}

PhaseSpan phase_span_from_json(const Json& p) {
  PhaseSpan span;
  span.phase = phase_from_name(p.at("phase").get<std::string>());
  if (p.contains("name")) {
    span.name = p.at("name").get<std::string>();
  }
  span.step = count_at(p, "step");
  span.begin_ns = count_at(p, "begin_ns");
  span.end_ns = count_at(p, "end_ns");
  TORCH_CHECK(span.end_ns >= span.begin_ns, "report_from_json: a phase ends (", span.end_ns,
              " ns) before it begins (", span.begin_ns, " ns)");
  span.peak_bytes = count_at(p, "peak_bytes");
  span.peak_by_category = category_bytes_from(p.at("peak_by_category_bytes"));
  if (p.contains("saved_bytes")) {
    span.saved_bytes = count_at(p, "saved_bytes");
  }
  return span;
}

std::vector<TimelinePoint> series_from_json(const Json& series) {
  std::vector<TimelinePoint> out;
  const auto& times = series.at("time_ns");
  TORCH_CHECK(times.is_array(), "report_from_json: expected series.time_ns to be an array");
  out.resize(times.size());
  for (size_t i = 0; i < times.size(); ++i) {
    out[i].time_ns = int_value(times[i], "a series time", 0, kMaxReportBytes);
  }
  for (auto it = series.at("bytes").begin(); it != series.at("bytes").end(); ++it) {
    const int c = static_cast<int>(category_from_name(it.key()));
    TORCH_CHECK(it.value().is_array() && it.value().size() == times.size(), "report_from_json: series \"",
                it.key(), "\" has ", it.value().size(), " points, but time_ns has ", times.size());
    for (size_t i = 0; i < times.size(); ++i) {
      out[i].bytes[c] = int_value(it.value()[i], "series \"" + it.key() + "\" bytes", 0, kMaxReportBytes);
    }
  }
  return out;
}

} // namespace

void from_json(const Json& j, AuditReport& r) {
  TORCH_CHECK(j.is_object(), "report_from_json: expected a JSON object, but got ", j.type_name());
  TORCH_CHECK(j.contains("schema") && j["schema"].is_string(),
              "report_from_json: no \"schema\" key; is this a trainmem report?");
  const auto schema = j["schema"].get<std::string>();
  TORCH_CHECK(schema == "trainmem/1", "report_from_json: expected schema \"trainmem/1\", but got \"", schema, "\"");
  r = AuditReport{};
  try {
    r.title = j.at("title").get<std::string>();
    for (auto it = j.at("config").begin(); it != j.at("config").end(); ++it) {
      r.config.emplace_back(it.key(), it.value().get<std::string>());
    }
    r.device = j.at("device").get<std::string>();
    r.num_params = count_at(j, "num_params");
    for (const auto& b : j.at("buckets")) {
      r.buckets.push_back({b.at("name").get<std::string>(),
                           category_from_name(b.at("category").get<std::string>()), count_at(b, "bytes")});
    }
    r.saved_activation_bytes = count_at(j, "saved_activation_bytes");
    r.saved_device_bytes = j.contains("saved_device_bytes") ? count_at(j, "saved_device_bytes") : r.saved_activation_bytes;
    r.saved_host_bytes = j.contains("saved_host_bytes") ? count_at(j, "saved_host_bytes") : 0;
    for (const auto& n : j.at("saved_by_node")) {
      r.saved_by_node.push_back({n.at("node").get<std::string>(), count_at(n, "bytes"), count_at(n, "num_tensors")});
    }
    r.predicted_activation_bytes = count_at(j, "predicted_activation_bytes", -1);  // -1: none
    for (const auto& s : j.at("steps")) {
      r.steps.push_back(step_from_json(s));
    }
    r.peak_bytes = count_at(j, "peak_bytes");
    r.peak_by_category = category_bytes_from(j.at("peak_by_category_bytes"));
    r.device_stats = device_stats_from_json(j.at("device_stats"));
    const auto& f = j.at("fragmentation");
    r.fragmentation.slack_bytes = count_at(f, "slack_bytes");
    r.fragmentation.inactive_split_bytes = count_at(f, "inactive_split_bytes");
    r.fragmentation.slack_fraction = number_at(f, "slack_fraction", 0.0, 1.0);
    r.fragmentation.hints = f.at("hints").get<std::vector<std::string>>();
    for (const auto& p : j.at("phases")) {
      r.phases.push_back(phase_span_from_json(p));
    }
    r.series = series_from_json(j.at("series"));
    r.notes = j.at("notes").get<std::vector<std::string>>();
  } catch (const Json::exception& e) {
    TORCH_CHECK(false, "report_from_json: malformed trainmem/1 report: ", e.what());
  }
}

std::string to_json(const AuditReport& r, int indent) {
  return Json(r).dump(indent);
}

AuditReport report_from_json(const std::string& text) {
  return detail::parse_bounded_json<Json>(text, kMaxReportDepth, "report_from_json").get<AuditReport>();
}

// ---- Chrome trace -----------------------------------------------------------

namespace detail {

Json chrome_trace_json(const AuditReport& r) {
  Json events = Json::array();
  events.push_back({{"name", "process_name"}, {"ph", "M"}, {"pid", 1}, {"tid", 0},
                    {"args", {{"name", r.title + " (" + r.device + ")"}}}});
  events.push_back({{"name", "thread_name"}, {"ph", "M"}, {"pid", 1}, {"tid", 1},
                    {"args", {{"name", "phases"}}}});
  for (const auto& p : r.series) {
    Json args = Json::object();
    for (auto c : kCategories) {
      args[category_name(c)] = p.bytes[static_cast<int>(c)];
    }
    events.push_back({{"name", "live bytes by category"}, {"ph", "C"}, {"pid", 1}, {"tid", 0},
                      {"ts", static_cast<double>(p.time_ns) / 1000.0}, {"args", args}});
  }
  for (const auto& p : r.phases) {
    events.push_back({{"name", fmt::format("step {} {}", p.step, span_label(p))},
                      {"cat", phase_name(p.phase)},
                      {"ph", "X"},
                      {"pid", 1},
                      {"tid", 1},
                      {"ts", static_cast<double>(p.begin_ns) / 1000.0},
                      {"dur", static_cast<double>(p.end_ns - p.begin_ns) / 1000.0},
                      {"args", {{"peak_bytes", p.peak_bytes}}}});
  }
  return Json{{"displayTimeUnit", "ms"}, {"traceEvents", events}};
}

} // namespace detail

std::string to_chrome_trace(const AuditReport& r) {
  return detail::chrome_trace_json(r).dump();
}

} // namespace trainmem

#include "trainmem/report.h"

#include <algorithm>
#include <cmath>

#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

namespace trainmem {
namespace {

using Json = nlohmann::ordered_json;

constexpr std::array<Category, kNumCategories> kCategories = {
    Category::kParameter, Category::kGradient,  Category::kOptimizerState,
    Category::kActivation, Category::kTemporary, Category::kInput,
    Category::kUnknown, Category::kBeforeAudit};

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

CategoryBytes category_bytes_from(const Json& j) {
  CategoryBytes b{};
  for (auto it = j.begin(); it != j.end(); ++it) {
    b[static_cast<int>(category_from_name(it.key()))] = it.value().get<int64_t>();
  }
  return b;
}

std::string pct(int64_t part, int64_t whole) {
  return whole > 0 ? fmt::format("{:.1f} %", 100.0 * static_cast<double>(part) / static_cast<double>(whole))
                   : std::string("-");
}

} // namespace

std::string with_commas(int64_t value) {
  std::string digits = std::to_string(value < 0 ? -value : value);
  std::string out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) {
      out += ',';
    }
    out += digits[i];
  }
  return value < 0 ? "-" + out : out;
}

std::string human_bytes(int64_t bytes) {
  const double b = static_cast<double>(bytes);
  const double a = std::abs(b);
  if (a >= 1024.0 * 1024 * 1024) {
    return fmt::format("{:.1f} GiB", b / (1024.0 * 1024 * 1024));
  }
  if (a >= 1024.0 * 1024) {
    return fmt::format("{:.1f} MiB", b / (1024.0 * 1024));
  }
  if (a >= 1024.0) {
    return fmt::format("{:.1f} KiB", b / 1024.0);
  }
  return fmt::format("{} B", bytes);
}

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
  auto stat = [&](auto get) {
    std::vector<int64_t> v;
    v.reserve(steps.size());
    for (const auto& s : steps) {
      v.push_back(get(s));
    }
    std::sort(v.begin(), v.end());
    return StepStat{v.front(), v[(v.size() - 1) / 2], v.back()};
  };
  StepSummary sum;
  sum.num_steps = static_cast<int64_t>(steps.size());
  sum.peak_bytes = stat([](const StepRecord& s) { return s.peak_bytes; });
  sum.forward_peak_bytes = stat([](const StepRecord& s) { return s.forward_peak_bytes; });
  sum.backward_peak_bytes = stat([](const StepRecord& s) { return s.backward_peak_bytes; });
  sum.optimizer_peak_bytes = stat([](const StepRecord& s) { return s.optimizer_peak_bytes; });
  sum.saved_activation_bytes = stat([](const StepRecord& s) { return s.saved_activation_bytes; });
  sum.time_us = stat([](const StepRecord& s) { return static_cast<int64_t>(std::llround(s.time_ms * 1000.0)); });
  return sum;
}

std::string to_text(const AuditReport& r) {
  std::string out = fmt::format("trainmem audit: {} on {}\n", r.title, r.device);
  if (!r.config.empty()) {
    std::string line;
    for (const auto& [k, v] : r.config) {
      line += fmt::format("{}{}={}", line.empty() ? "" : " ", k, v);
    }
    out += "  " + line + "\n";
  }
  out += fmt::format("\nstatic buckets ({} parameters)\n", with_commas(r.num_params));
  for (const auto& b : r.buckets) {
    out += fmt::format("  {:<36} {:>16} B  {:>10}\n", b.name, with_commas(b.bytes), human_bytes(b.bytes));
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
  const size_t top = std::min<size_t>(r.saved_by_node.size(), 8);
  for (size_t i = 0; i < top; ++i) {
    const auto& n = r.saved_by_node[i];
    out += fmt::format("  {:<46} {:>16} B  {:>8}\n", n.node, with_commas(n.bytes),
                       pct(n.bytes, r.saved_activation_bytes));
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
  out += fmt::format("\ndevice {}: allocated {} B (peak {}), reserved {} B (peak {})\n", d.device,
                     with_commas(d.allocated_bytes), with_commas(d.peak_allocated_bytes),
                     with_commas(d.reserved_bytes), with_commas(d.peak_reserved_bytes));
  if (d.num_alloc_retries > 0 || d.num_ooms > 0) {
    out += fmt::format("  allocation retries {}, OOMs {}\n", d.num_alloc_retries, d.num_ooms);
  }
  out += fmt::format("fragmentation: slack {} B, inactive split {} B\n", with_commas(r.fragmentation.slack_bytes),
                     with_commas(r.fragmentation.inactive_split_bytes));
  for (const auto& h : r.fragmentation.hints) {
    out += "  hint: " + h + "\n";
  }
  for (const auto& n : r.notes) {
    out += "note: " + n + "\n";
  }
  return out;
}

// ---- JSON -------------------------------------------------------------------

std::string to_json(const AuditReport& r, int indent) {
  Json j;
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
                     {"saved_activation_bytes", s.saved_activation_bytes}});
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
  return j.dump(indent);
}

AuditReport report_from_json(const std::string& text) {
  Json j;
  try {
    j = Json::parse(text);
  } catch (const Json::parse_error& e) {
    TORCH_CHECK(false, "report_from_json: not JSON: ", e.what());
  }
  TORCH_CHECK(j.is_object(), "report_from_json: expected a JSON object, but got ", j.type_name());
  TORCH_CHECK(j.contains("schema") && j["schema"].is_string(),
              "report_from_json: no \"schema\" key; is this a trainmem report?");
  const auto schema = j["schema"].get<std::string>();
  TORCH_CHECK(schema == "trainmem/1", "report_from_json: expected schema \"trainmem/1\", but got \"", schema, "\"");
  AuditReport r;
  try {
    r.title = j.at("title").get<std::string>();
    for (auto it = j.at("config").begin(); it != j.at("config").end(); ++it) {
      r.config.emplace_back(it.key(), it.value().get<std::string>());
    }
    r.device = j.at("device").get<std::string>();
    r.num_params = j.at("num_params").get<int64_t>();
    for (const auto& b : j.at("buckets")) {
      r.buckets.push_back({b.at("name").get<std::string>(),
                           category_from_name(b.at("category").get<std::string>()),
                           b.at("bytes").get<int64_t>()});
    }
    r.saved_activation_bytes = j.at("saved_activation_bytes").get<int64_t>();
    r.saved_device_bytes = j.value("saved_device_bytes", r.saved_activation_bytes);
    r.saved_host_bytes = j.value("saved_host_bytes", int64_t{0});
    for (const auto& n : j.at("saved_by_node")) {
      r.saved_by_node.push_back({n.at("node").get<std::string>(), n.at("bytes").get<int64_t>(),
                                 n.at("num_tensors").get<int64_t>()});
    }
    r.predicted_activation_bytes = j.at("predicted_activation_bytes").get<int64_t>();
    for (const auto& s : j.at("steps")) {
      StepRecord rec;
      rec.step = s.at("step").get<int64_t>();
      rec.time_ms = s.at("time_ms").get<double>();
      rec.peak_bytes = s.at("peak_bytes").get<int64_t>();
      rec.forward_peak_bytes = s.at("forward_peak_bytes").get<int64_t>();
      rec.backward_peak_bytes = s.at("backward_peak_bytes").get<int64_t>();
      rec.optimizer_peak_bytes = s.at("optimizer_peak_bytes").get<int64_t>();
      rec.saved_activation_bytes = s.at("saved_activation_bytes").get<int64_t>();
      r.steps.push_back(rec);
    }
    r.peak_bytes = j.at("peak_bytes").get<int64_t>();
    r.peak_by_category = category_bytes_from(j.at("peak_by_category_bytes"));
    const auto& d = j.at("device_stats");
    auto& s = r.device_stats;
    s.device = d.at("device").get<std::string>();
    s.allocated_bytes = d.at("allocated_bytes").get<int64_t>();
    s.peak_allocated_bytes = d.at("peak_allocated_bytes").get<int64_t>();
    s.reserved_bytes = d.at("reserved_bytes").get<int64_t>();
    s.peak_reserved_bytes = d.at("peak_reserved_bytes").get<int64_t>();
    s.active_bytes = d.at("active_bytes").get<int64_t>();
    s.peak_active_bytes = d.at("peak_active_bytes").get<int64_t>();
    s.inactive_split_bytes = d.at("inactive_split_bytes").get<int64_t>();
    s.peak_inactive_split_bytes = d.at("peak_inactive_split_bytes").get<int64_t>();
    s.requested_bytes = d.at("requested_bytes").get<int64_t>();
    s.num_allocs = d.at("num_allocs").get<int64_t>();
    s.num_frees = d.at("num_frees").get<int64_t>();
    s.num_alloc_retries = d.at("num_alloc_retries").get<int64_t>();
    s.num_ooms = d.at("num_ooms").get<int64_t>();
    const auto& f = j.at("fragmentation");
    r.fragmentation.slack_bytes = f.at("slack_bytes").get<int64_t>();
    r.fragmentation.inactive_split_bytes = f.at("inactive_split_bytes").get<int64_t>();
    r.fragmentation.slack_fraction = f.at("slack_fraction").get<double>();
    r.fragmentation.hints = f.at("hints").get<std::vector<std::string>>();
    for (const auto& p : j.at("phases")) {
      PhaseSpan span;
      span.phase = phase_from_name(p.at("phase").get<std::string>());
      if (p.contains("name")) {
        span.name = p.at("name").get<std::string>();
      }
      span.step = p.at("step").get<int64_t>();
      span.begin_ns = p.at("begin_ns").get<int64_t>();
      span.end_ns = p.at("end_ns").get<int64_t>();
      span.peak_bytes = p.at("peak_bytes").get<int64_t>();
      span.peak_by_category = category_bytes_from(p.at("peak_by_category_bytes"));
      r.phases.push_back(span);
    }
    const auto& series = j.at("series");
    const auto& times = series.at("time_ns");
    r.series.resize(times.size());
    for (size_t i = 0; i < times.size(); ++i) {
      r.series[i].time_ns = times[i].get<int64_t>();
    }
    for (auto it = series.at("bytes").begin(); it != series.at("bytes").end(); ++it) {
      const int c = static_cast<int>(category_from_name(it.key()));
      TORCH_CHECK(it.value().size() == times.size(), "report_from_json: series \"", it.key(), "\" has ",
                  it.value().size(), " points, but time_ns has ", times.size());
      for (size_t i = 0; i < times.size(); ++i) {
        r.series[i].bytes[c] = it.value()[i].get<int64_t>();
      }
    }
    r.notes = j.at("notes").get<std::vector<std::string>>();
  } catch (const Json::exception& e) {
    TORCH_CHECK(false, "report_from_json: malformed trainmem/1 report: ", e.what());
  }
  return r;
}

// ---- Chrome trace -----------------------------------------------------------

std::string to_chrome_trace(const AuditReport& r) {
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
  Json j = {{"displayTimeUnit", "ms"}, {"traceEvents", events}};
  return j.dump();
}

} // namespace trainmem

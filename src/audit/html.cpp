// The self-contained HTML report (report.h: to_html).

#include <algorithm>
#include <array>

#include <fmt/format.h>

#include "trainmem/report.h"
#include "detail/text.h"

// Note [Self-contained HTML]
// Users open these reports on air-gapped clusters and attach them to
// tickets: no script, font or image is fetched. The Content-Security-Policy
// meta tag forbids every fetch, so a future edit that adds one fails loudly
// in the browser and in the test that parses the page.

namespace trainmem {
namespace {

// Stacking order (bottom first) and colours.
constexpr std::array<std::pair<Category, const char*>, kNumCategories> kStack = {{
    {Category::kBeforeAudit, "#e4e1dc"},
    {Category::kParameter, "#4e79a7"},
    {Category::kBuffer, "#a0cbe8"},  // a lighter parameter blue: module state beside the weights
    {Category::kGradient, "#f28e2b"},
    {Category::kOptimizerState, "#59a14f"},
    {Category::kCommunication, "#76b7b2"},
    {Category::kInput, "#b07aa1"},
    {Category::kActivation, "#e15759"},
    {Category::kTemporary, "#edc948"},
    {Category::kUnknown, "#bab0ac"},
}};

const char* phase_colour(Phase p) {
  switch (p) {
    case Phase::kForward: return "#dbe9f6";
    case Phase::kBackward: return "#fde3d0";
    case Phase::kOptimizerStep: return "#dff0d8";
  }
  return "#eeeeee";
}

// `with_baseline` false: the "before the audit" bytes are left out and the
// axis rescaled, so a step's own memory fills the plot.
std::string svg_plot(const AuditReport& r, bool with_baseline) {
  constexpr double kW = 960, kH = 320, kLeft = 80, kRight = 20, kTop = 16, kBottom = 36;
  if (r.series.size() < 2) {
    return "<p>No timeline was recorded (CUDA audits, or timeline off).</p>\n";
  }
  const double t0 = static_cast<double>(r.series.front().time_ns);
  const double t1 = std::max(static_cast<double>(r.series.back().time_ns), t0 + 1);
  const auto shown = [&](const TimelinePoint& p) {
    return p.total_bytes() - (with_baseline ? 0 : p.bytes[static_cast<int>(Category::kBeforeAudit)]);
  };
  int64_t ymax = 1;
  for (const auto& p : r.series) {
    ymax = std::max(ymax, shown(p));
  }
  const double pw = kW - kLeft - kRight, ph = kH - kTop - kBottom;
  auto x = [&](double t) { return kLeft + (t - t0) / (t1 - t0) * pw; };
  auto y = [&](double b) { return kTop + ph - b / static_cast<double>(ymax) * ph; };

  std::string svg = fmt::format(
      "<svg width=\"{}\" height=\"{}\" viewBox=\"0 0 {} {}\" "
      "role=\"img\" aria-label=\"live bytes by category over time\">\n",
      kW, kH, kW, kH);
  for (const auto& p : r.phases) {
    const double a = std::max(x(static_cast<double>(p.begin_ns)), kLeft);
    const double b = std::min(x(static_cast<double>(p.end_ns)), kLeft + pw);
    if (b <= a) {
      continue;
    }
    svg += fmt::format(
        "<rect x=\"{:.1f}\" y=\"{}\" width=\"{:.1f}\" height=\"{}\" fill=\"{}\">"
        "<title>step {} {}: peak {} B</title></rect>\n",
        a, kTop, b - a, ph, phase_colour(p.phase), p.step, detail::html_escape(span_label(p)), with_commas(p.peak_bytes));
  }
  // One polygon per category between the cumulative sums below and above it.
  std::vector<double> below(r.series.size(), 0.0);
  for (const auto& [cat, colour] : kStack) {
    if (!with_baseline && cat == Category::kBeforeAudit) {
      continue;
    }
    std::vector<double> above = below;
    bool any = false;
    for (size_t i = 0; i < r.series.size(); ++i) {
      const auto b = r.series[i].bytes[static_cast<int>(cat)];
      above[i] += static_cast<double>(b);
      any = any || b != 0;
    }
    if (any) {
      std::string pts;
      for (size_t i = 0; i < r.series.size(); ++i) {
        pts += fmt::format("{:.1f},{:.1f} ", x(static_cast<double>(r.series[i].time_ns)), y(above[i]));
      }
      for (size_t i = r.series.size(); i-- > 0;) {
        pts += fmt::format("{:.1f},{:.1f} ", x(static_cast<double>(r.series[i].time_ns)), y(below[i]));
      }
      svg += fmt::format("<polygon points=\"{}\" fill=\"{}\" fill-opacity=\"0.9\"><title>{}</title></polygon>\n",
                         pts, colour, category_name(cat));
    }
    below = std::move(above);
  }
  for (int i = 0; i <= 4; ++i) {
    const double b = static_cast<double>(ymax) * i / 4.0;
    svg += fmt::format(
        "<line x1=\"{}\" x2=\"{}\" y1=\"{:.1f}\" y2=\"{:.1f}\" stroke=\"#999\" stroke-width=\"0.5\"/>"
        "<text x=\"{}\" y=\"{:.1f}\" font-size=\"11\" text-anchor=\"end\">{}</text>\n",
        kLeft, kLeft + pw, y(b), y(b), kLeft - 6, y(b) + 4, detail::html_escape(human_bytes(static_cast<int64_t>(b))));
  }
  for (int i = 0; i <= 4; ++i) {
    const double t = t0 + (t1 - t0) * i / 4.0;
    svg += fmt::format("<text x=\"{:.1f}\" y=\"{}\" font-size=\"11\" text-anchor=\"{}\">{:.1f} ms</text>\n",
                       x(t), kH - 14, i == 0 ? "start" : i == 4 ? "end" : "middle", (t - t0) / 1e6);
  }
  svg += "</svg>\n<p class=\"legend\">";
  for (const auto& [cat, colour] : kStack) {
    svg += fmt::format("<span><i style=\"background:{}\"></i>{}</span> ", colour, category_name(cat));
  }
  svg += "&nbsp; bands: ";
  for (int p = 0; p < kNumPhases; ++p) {
    svg += fmt::format("<span><i style=\"background:{}\"></i>{}</span> ", phase_colour(static_cast<Phase>(p)),
                       phase_name(static_cast<Phase>(p)));
  }
  return svg + "</p>\n";
}

std::string row(std::initializer_list<std::string> cells, bool header = false) {
  std::string out = "<tr>";
  for (const auto& c : cells) {
    out += header ? "<th>" + c + "</th>" : "<td>" + c + "</td>";
  }
  return out + "</tr>\n";
}

std::string number_cell(int64_t v) {
  return "<td class=\"n\">" + with_commas(v) + "</td>";
}

// The page's head and title, and the run's settings.
std::string head_html(const AuditReport& r) {
  std::string h =
      "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
      "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; "
      "style-src 'unsafe-inline'; img-src data:\">\n";
  h += fmt::format("<title>trainmem audit: {}</title>\n", detail::html_escape(r.title));
  h += "<style>body{font:14px sans-serif;margin:24px;color:#222}table{border-collapse:collapse;margin:8px 0 20px}"
       "td,th{border:1px solid #ccc;padding:3px 8px}td.n{text-align:right;font-family:monospace}"
       ".legend span{margin-right:12px}.legend i{display:inline-block;width:12px;height:12px;margin-right:4px;"
       "vertical-align:middle}#hide-baseline:checked~.with-baseline{display:none}"
       "#hide-baseline:not(:checked)~.without-baseline{display:none}</style>\n</head>\n<body>\n";
  h += fmt::format("<h1>trainmem audit: {} on {}</h1>\n", detail::html_escape(r.title), detail::html_escape(r.device));
  if (!r.config.empty()) {
    h += "<p>";
    for (const auto& [k, v] : r.config) {
      h += fmt::format("<code>{}={}</code> ", detail::html_escape(k), detail::html_escape(v));
    }
    h += "</p>\n";
  }
  return h;
}

// The live bytes over time, with and without the baseline when there is one.
std::string plot_html(const AuditReport& r) {
  std::string h = "<h2>Live bytes over time, by category</h2>\n";
  bool baseline = false;
  for (const auto& p : r.series) {
    baseline = baseline || p.bytes[static_cast<int>(Category::kBeforeAudit)] != 0;
  }
  if (baseline) {
    // No script may run (Note [Self-contained HTML]): a checkbox and CSS
    // switch between the plot with and without the baseline.
    h += "<input type=\"checkbox\" id=\"hide-baseline\"><label for=\"hide-baseline\"> hide the bytes live "
         "before the audit (baseline)</label>\n<div class=\"with-baseline\">\n" +
         svg_plot(r, true) + "</div>\n<div class=\"without-baseline\">\n" + svg_plot(r, false) + "</div>\n";
  } else {
    h += svg_plot(r, true);
  }
  return h;
}

std::string buckets_html(const AuditReport& r) {
  const auto num = number_cell;
  std::string h = fmt::format("<h2>Static buckets ({} parameters)</h2>\n<table>\n", with_commas(r.num_params));
  h += row({"bucket", "category", "bytes", ""}, true);
  for (const auto& b : r.buckets) {
    h += "<tr><td>" + detail::html_escape(b.name) + "</td><td>" + category_name(b.category) + "</td>" + num(b.bytes) +
         "<td>" + human_bytes(b.bytes) + "</td></tr>\n";
  }
  h += "<tr><th>total</th><td></td>" + num(r.static_bytes()) + "<td>" + human_bytes(r.static_bytes()) +
       "</td></tr>\n</table>\n";
  return h;
}

// Each step, or the first three and a summary when there are more than kMaxStepRows.
std::string steps_html(const AuditReport& r) {
  const auto num = number_cell;
  std::string h = "<h2>Steps</h2>\n<table>\n";
  h += row({"step", "time ms", "peak B", "forward peak B", "backward peak B", "optimizer peak B", "saved B"}, true);
  const bool summarize = static_cast<int64_t>(r.steps.size()) > kMaxStepRows;
  for (size_t i = 0; i < (summarize ? 3 : r.steps.size()); ++i) {
    const auto& s = r.steps[i];
    h += fmt::format("<tr><td>{}</td><td class=\"n\">{:.1f}</td>", s.step, s.time_ms) + num(s.peak_bytes) +
         num(s.forward_peak_bytes) + num(s.backward_peak_bytes) + num(s.optimizer_peak_bytes) +
         (s.metered || s.repeats >= 0 ? num(s.saved_activation_bytes)  // a repeat's are exact too
                                       : std::string("<td class=\"n\">not known</td>")) + "</tr>\n";
  }
  if (summarize) {
    const auto sum = summarize_steps(r.steps);
    h += fmt::format("<tr><th colspan=\"7\">{} steps in all</th></tr>\n", sum.num_steps);
    const std::pair<const char*, int64_t StepStat::*> stats[] = {
        {"min", &StepStat::min}, {"median", &StepStat::median}, {"max", &StepStat::max}};
    for (const auto& [label, f] : stats) {
      h += fmt::format("<tr><td>{}</td><td class=\"n\">{:.1f}</td>", label,
                       static_cast<double>(sum.time_us.*f) / 1000.0) +
           num(sum.peak_bytes.*f) + num(sum.forward_peak_bytes.*f) + num(sum.backward_peak_bytes.*f) +
           num(sum.optimizer_peak_bytes.*f) + num(sum.saved_activation_bytes.*f) + "</tr>\n";
    }
  }
  h += "</table>\n";
  return h;
}

// The categories live at the peak, when the timeline has them.
std::string peak_html(const AuditReport& r) {
  const auto num = number_cell;
  std::string h;
  int64_t at_peak = 0;
  for (auto b : r.peak_by_category) {
    at_peak += b;
  }
  if (at_peak > 0) {
    h += "<h2>Live at the peak</h2>\n<table>\n" + row({"category", "bytes"}, true);
    for (const auto& [cat, colour] : kStack) {
      const auto b = r.peak_by_category[static_cast<int>(cat)];
      if (b != 0) {
        h += std::string("<tr><td>") + category_name(cat) + "</td>" + num(b) + "</tr>\n";
      }
    }
    h += "</table>\n";
  }
  return h;
}

// The saved tensors, by autograd node, and the prediction beside them.
std::string saved_html(const AuditReport& r) {
  const auto num = number_cell;
  std::string h = fmt::format("<h2>Saved for backward: {} B</h2>\n", with_commas(r.saved_activation_bytes));
  if (r.saved_host_bytes > 0) {
    h += fmt::format("<p>{} B stay on the device, {} B are offloaded to the host.</p>\n",
                     with_commas(r.saved_device_bytes), with_commas(r.saved_host_bytes));
  }
  h += "<table>\n";
  h += row({"autograd node", "bytes", "tensors"}, true);
  const size_t top = std::min<size_t>(r.saved_by_node.size(), 15);
  for (size_t i = 0; i < top; ++i) {
    const auto& n = r.saved_by_node[i];
    h += "<tr><td>" + detail::html_escape(n.node) + "</td>" + num(n.bytes) + num(n.num_tensors) + "</tr>\n";
  }
  h += "</table>\n";
  if (r.predicted_activation_bytes > 0) {
    h += fmt::format("<p>Predicted: {} B (measured / predicted {:.3f}).</p>\n",
                     with_commas(r.predicted_activation_bytes),
                     static_cast<double>(r.saved_activation_bytes) / static_cast<double>(r.predicted_activation_bytes));
  }
  return h;
}

// The device's statistics, fragmentation, hints and notes.
std::string device_html(const AuditReport& r) {
  const auto num = number_cell;
  const auto& d = r.device_stats;
  std::string h = fmt::format("<h2>Device {}</h2>\n<table>\n", detail::html_escape(d.device));
  h += row({"", "now B", "peak B"}, true);
  h += "<tr><td>allocated</td>" + num(d.allocated_bytes) + num(d.peak_allocated_bytes) + "</tr>\n";
  h += "<tr><td>reserved</td>" + num(d.reserved_bytes) + num(d.peak_reserved_bytes) + "</tr>\n";
  h += "<tr><td>inactive split</td>" + num(d.inactive_split_bytes) + num(d.peak_inactive_split_bytes) + "</tr>\n";
  h += "</table>\n";
  h += fmt::format("<p>Fragmentation: slack {} B, inactive split {} B.</p>\n",
                   with_commas(r.fragmentation.slack_bytes), with_commas(r.fragmentation.inactive_split_bytes));
  if (!r.fragmentation.hints.empty() || !r.notes.empty()) {
    h += "<ul>\n";
    for (const auto& hint : r.fragmentation.hints) {
      h += "<li>hint: " + detail::html_escape(hint) + "</li>\n";
    }
    for (const auto& n : r.notes) {
      h += "<li>note: " + detail::html_escape(n) + "</li>\n";
    }
    h += "</ul>\n";
  }
  return h;
}

} // namespace

std::string to_html(const AuditReport& r) {
  return head_html(r) + plot_html(r) + buckets_html(r) + steps_html(r) + peak_html(r) + saved_html(r) +
      device_html(r) + "</body>\n</html>\n";
}

} // namespace trainmem

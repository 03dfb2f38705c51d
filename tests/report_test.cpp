#include "trainmem/report.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/csrc/jit/serialization/pickle.h>

namespace {

using trainmem::Category;
using trainmem::Phase;

// A small report with every field set, as an audit would fill it.
trainmem::AuditReport sample_report() {
  trainmem::AuditReport r;
  r.title = "net <b>&</b>";
  r.config = {{"precision", "fp32"}, {"batch", "16"}};  // not in key order: reading keeps the file's order
  r.num_params = 1000;
  r.buckets = {{"parameters", Category::kParameter, 4000}, {"gradients", Category::kGradient, 4000},
               {"optimizer state (exp_avg)", Category::kOptimizerState, 4000}};
  r.saved_activation_bytes = 36864;
  r.saved_by_node = {{"AddmmBackward0", 20480, 2}, {"GeluBackward0", 16384, 1}};
  r.predicted_activation_bytes = 36000;
  r.steps = {{0, 12.5, 90000, 80000, 90000, 70000, 36864}};
  r.peak_bytes = 90000;
  r.peak_by_category = {4000, 4000, 0, 30000, 52000, 0, 0};
  r.device_stats.allocated_bytes = 16000;
  r.device_stats.peak_allocated_bytes = 90000;
  r.fragmentation.hints = {"a hint"};
  r.phases = {{Phase::kForward, "", 0, 0, 1000, 80000, {4000, 0, 0, 30000, 46000, 0, 0}},
              {Phase::kBackward, "", 0, 1000, 3000, 90000, {4000, 4000, 0, 30000, 52000, 0, 0}},
              {Phase::kOptimizerStep, "", 0, 3000, 4000, 70000, {}}};
  for (int i = 0; i < 5; ++i) {
    trainmem::TimelinePoint p;
    p.time_ns = i * 1000;
    p.bytes = {4000, i * 1000, 0, 10000 * i, 500, 0, 0};
    r.series.push_back(p);
  }
  r.notes = {"a note"};
  return r;
}

// The text's saved-by-node rows sum to the saved bytes: the largest
// kMaxNodeRows, then one row for the rest.
TEST(ReportTest, TextNodeRowsEndWithTheRest) {
  auto r = sample_report();
  r.saved_by_node.clear();
  int64_t total = 0;
  for (int i = 0; i < 11; ++i) {
    const int64_t bytes = 1000 * (11 - i);  // 11,000 ... 1,000
    r.saved_by_node.push_back({"Node" + std::to_string(i), bytes, 1});
    total += bytes;
  }
  r.saved_activation_bytes = total;  // 66,000
  const auto text = trainmem::to_text(r);
  EXPECT_NE(text.find("Node7 "), std::string::npos) << text;
  EXPECT_EQ(text.find("Node8 "), std::string::npos) << text;
  // Nodes 8, 9 and 10: 3,000 + 2,000 + 1,000 B, 9.1 % of 66,000.
  EXPECT_NE(text.find("other (3 nodes)"), std::string::npos) << text;
  const auto at = text.find("other (3 nodes)");
  const auto line = text.substr(at, text.find('\n', at) - at);
  EXPECT_NE(line.find(" 6,000 B"), std::string::npos) << line;
  EXPECT_NE(line.find("9.1 %"), std::string::npos) << line;
  // Eight nodes or fewer: no such row.
  r.saved_by_node.resize(8);
  EXPECT_EQ(trainmem::to_text(r).find("other ("), std::string::npos);
}

TEST(ReportTest, JsonRoundTripsExactly) {
  const auto r = sample_report();
  const auto json = trainmem::to_json(r);
  const auto back = trainmem::report_from_json(json);
  EXPECT_EQ(trainmem::to_json(back), json);
  EXPECT_EQ(back.steps[0].peak_bytes, 90000);
  EXPECT_EQ(back.phases[1].peak_by_category[static_cast<int>(Category::kTemporary)], 52000);
  const auto j = nlohmann::json::parse(json);
  EXPECT_EQ(j["schema"], "trainmem/1");
  EXPECT_EQ(j["static_bytes"], 12000);
  EXPECT_TRUE(j["saved_activation_bytes"].is_number_integer());
}

TEST(ReportTest, BadJsonNamesTheProblem) {
  auto message = [](const std::string& text) {
    try {
      trainmem::report_from_json(text);
    } catch (const c10::Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(message("{not json").find("not JSON"), std::string::npos);
  EXPECT_NE(message("[1, 2]").find("expected a JSON object, but got array"), std::string::npos);
  EXPECT_NE(message(R"({"schema": "trainmem/2"})").find("but got \"trainmem/2\""), std::string::npos);
  EXPECT_NE(message(R"({"schema": "trainmem/1"})").find("malformed trainmem/1 report"), std::string::npos);
  auto j = nlohmann::json::parse(trainmem::to_json(sample_report()));
  j["buckets"][0]["category"] = "WEIGHTS";
  EXPECT_NE(message(j.dump()).find("unknown category \"WEIGHTS\""), std::string::npos);
}

TEST(ReportTest, HtmlIsSelfContainedAndEscaped) {
  const auto html = trainmem::to_html(sample_report());
  EXPECT_NE(html.find("<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; "
                      "style-src 'unsafe-inline'; img-src data:\">"),
            std::string::npos);
  for (const char* banned : {"<script", "http:", "https:", "src=", "href=", "url(", "@import"}) {
    EXPECT_EQ(html.find(banned), std::string::npos) << banned;
  }
  EXPECT_NE(html.find("net &lt;b&gt;&amp;&lt;/b&gt;"), std::string::npos);
  EXPECT_EQ(html.find("<b>&</b>"), std::string::npos);
  EXPECT_NE(html.find("<svg"), std::string::npos);
  EXPECT_NE(html.find("<title>ACTIVATION</title>"), std::string::npos);
  EXPECT_NE(html.find("<title>step 0 backward: peak 90,000 B</title>"), std::string::npos);
  EXPECT_NE(html.find("36,864"), std::string::npos);
}

TEST(ReportTest, ChromeTraceHasCountersPerCategoryAndPhaseSlices) {
  const auto j = nlohmann::json::parse(trainmem::to_chrome_trace(sample_report()));
  EXPECT_EQ(j["displayTimeUnit"], "ms");
  int counters = 0, slices = 0;
  for (const auto& e : j["traceEvents"]) {
    if (e["ph"] == "C") {
      ++counters;
      EXPECT_EQ(e["args"].size(), static_cast<size_t>(trainmem::kNumCategories));  // one counter per category
      EXPECT_TRUE(e["args"]["ACTIVATION"].is_number_integer());
    } else if (e["ph"] == "X") {
      ++slices;
      EXPECT_GE(e["dur"].get<double>(), 0.0);
    }
  }
  EXPECT_EQ(counters, 5);
  EXPECT_EQ(slices, 3);
}

// The pickle is read back by LibTorch's own unpickler: same opcodes Python uses.
TEST(ReportTest, MemoryVizPickleReadsBack) {
  trainmem::Timeline t;
  const uint64_t big_address = 0x7fff00001000ULL;  // needs LONG1 (beyond 32 bits)
  t.events = {{10, 1 << 20, 0x1000, Category::kActivation, Phase::kForward, 0},
              {20, 256, big_address, Category::kTemporary, Phase::kForward, 0},
              {30, -256, big_address, Category::kTemporary, Phase::kBackward, 0},
              {40, 100, 0, Category::kUnknown, Phase::kForward, 0}};  // adjustment: not a block
  const auto bytes = trainmem::to_memory_viz_pickle(t);
  ASSERT_GE(bytes.size(), 3u);
  EXPECT_EQ(bytes.substr(0, 2), std::string("\x80\x02", 2));
  EXPECT_EQ(bytes.back(), '.');
  const auto v = torch::jit::unpickle(bytes.data(), bytes.size());
  ASSERT_TRUE(v.isGenericDict());
  const auto d = v.toGenericDict();
  const auto segments = d.at("segments").toList();
  ASSERT_EQ(segments.size(), 1u);  // only the 1 MiB block is still live
  const auto seg = segments.get(0).toGenericDict();
  EXPECT_EQ(seg.at("total_size").toInt(), 1 << 20);
  EXPECT_EQ(seg.at("address").toInt(), 0x1000);
  EXPECT_EQ(seg.at("segment_type").toStringRef(), "large");
  const auto trace = d.at("device_traces").toList().get(0).toList();
  // Each CPU block is its own segment (Note [CPU blocks as memory_viz segments]).
  const std::vector<std::string> actions = {"segment_alloc", "alloc", "segment_alloc", "alloc",
                                            "free_requested", "free_completed", "segment_free"};
  ASSERT_EQ(trace.size(), actions.size());
  for (size_t i = 0; i < actions.size(); ++i) {
    EXPECT_EQ(trace.get(i).toGenericDict().at("action").toStringRef(), actions[i]) << "entry " << i;
  }
  EXPECT_EQ(trace.get(6).toGenericDict().at("size").toInt(), 256);
  EXPECT_EQ(trace.get(1).toGenericDict().at("category").toStringRef(), "activation");
  EXPECT_EQ(trace.get(6).toGenericDict().at("category").toStringRef(), "temporary");
  const auto frame = trace.get(1).toGenericDict().at("frames").toList().get(0).toGenericDict();
  EXPECT_EQ(frame.at("name").toStringRef(), "ACTIVATION in forward, step 0");
}

// A zero-byte block's alloc and free both carry 0 B: the first is its alloc.
TEST(ReportTest, MemoryVizZeroByteBlockIsAllocatedThenFreed) {
  trainmem::Timeline t;
  t.events = {{10, 0, 0x2000, Category::kTemporary, Phase::kForward, 0},
              {20, 0, 0x2000, Category::kTemporary, Phase::kForward, 0},
              {30, 0, 0x3000, Category::kActivation, Phase::kForward, 0}};  // still live
  const auto bytes = trainmem::to_memory_viz_pickle(t);
  const auto d = torch::jit::unpickle(bytes.data(), bytes.size()).toGenericDict();
  const auto trace = d.at("device_traces").toList().get(0).toList();
  const std::vector<std::string> actions = {"segment_alloc", "alloc", "free_requested", "free_completed",
                                            "segment_free", "segment_alloc", "alloc"};
  ASSERT_EQ(trace.size(), actions.size());
  for (size_t i = 0; i < actions.size(); ++i) {
    EXPECT_EQ(trace.get(i).toGenericDict().at("action").toStringRef(), actions[i]) << "entry " << i;
  }
  const auto segments = d.at("segments").toList();
  ASSERT_EQ(segments.size(), 1u);
  EXPECT_EQ(segments.get(0).toGenericDict().at("address").toInt(), 0x3000);
  EXPECT_EQ(segments.get(0).toGenericDict().at("total_size").toInt(), 0);
}

TEST(ReportTest, ThinningKeepsThePeak) {
  trainmem::Timeline t;
  for (int i = 0; i < 10000; ++i) {
    t.events.push_back({i, (i == 7777) ? 1000000 : 10, static_cast<uint64_t>(i + 1), Category::kTemporary,
                        Phase::kForward, 0});
    t.events.push_back({i, (i == 7777) ? -1000000 : -10, static_cast<uint64_t>(i + 1), Category::kTemporary,
                        Phase::kForward, 0});
  }
  const auto thin = trainmem::live_bytes(t, 100);
  EXPECT_LE(thin.size(), 100u);
  int64_t top = 0;
  for (const auto& p : thin) {
    top = std::max(top, p.total_bytes());
  }
  EXPECT_EQ(top, 1000000);
  EXPECT_THROW(trainmem::live_bytes(t, -1), c10::Error);
}

TEST(ReportTest, ByteFormatting) {
  EXPECT_EQ(trainmem::with_commas(51052544), "51,052,544");
  EXPECT_EQ(trainmem::with_commas(-1234), "-1,234");
  EXPECT_EQ(trainmem::with_commas(999), "999");
  EXPECT_EQ(trainmem::human_bytes(51052544), "48.7 MiB");
  EXPECT_EQ(trainmem::human_bytes(512), "512 B");
  EXPECT_EQ(trainmem::human_bytes(3LL << 30), "3.0 GiB");
}

} // namespace

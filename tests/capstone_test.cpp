// The capstone, the demo's reference transformer (six pre-LN blocks, d 128,
// 4 heads, input (16, 64, 128), loss out.pow(2).mean(), AdamW): static
// buckets and saved activations, exact.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/optim/adamw.h>

#include "app/variants.h"
#include "trainmem/accountant.h"
#include "trainmem/allocator.h"
#include "trainmem/meta.h"
#include "trainmem/meter.h"
#include "trainmem/planner.h"
#include "trainmem/selective.h"
#include "trainmem/models/transformer.h"

namespace {

using trainmem::kReferenceBatch;
using trainmem::kReferenceSeqLen;

int64_t node_bytes(const trainmem::SavedTensorReport& r, const std::string& node) {
  for (const auto& n : r.by_node) {
    if (n.node == node) return n.bytes;
  }
  return -1;
}

TEST(CapstoneTest, StaticBucketsMatchTheFormula) {
  torch::manual_seed(0);
  trainmem::TransformerOptions o;
  trainmem::Transformer model(o);
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-3));
  const int64_t P = trainmem::transformer_num_params(o);
  EXPECT_EQ(P, 1189632);  // L (12 d^2 + 13 d)

  auto x = torch::randn({kReferenceBatch, kReferenceSeqLen, o.d_model()});
  model->forward(x).pow(2).mean().backward();
  opt.step();
  const auto b = trainmem::account(*model, opt);
  EXPECT_EQ(b.num_params, P);
  EXPECT_EQ(b.param_bytes, 4758528);
  EXPECT_EQ(b.grad_bytes, 4758528);
  EXPECT_EQ(b.optimizer_state_bytes, 2 * b.param_bytes);
}

TEST(CapstoneTest, SavedActivationsAreExplainedToTheByte) {
  torch::manual_seed(0);
  trainmem::TransformerOptions o;
  trainmem::Transformer model(o);
  auto x = torch::randn({kReferenceBatch, kReferenceSeqLen, o.d_model()});

  trainmem::SavedTensorMeter meter(*model);
  at::Tensor loss;
  {
    trainmem::SavedTensorMeterGuard scope(meter);
    loss = model->forward(x).pow(2).mean();
  }
  const auto r = meter.report();
  const auto estimate = trainmem::estimate_activation_bytes(o, kReferenceBatch, kReferenceSeqLen);
  const int64_t predicted = trainmem::predicted_activation_bytes(o, kReferenceBatch, kReferenceSeqLen);
  EXPECT_EQ(predicted, 50331648);
  EXPECT_EQ(estimate.total_bytes, 51052544);
  EXPECT_EQ(r.saved_bytes, estimate.total_bytes) << trainmem::to_string(r);
  // measured / predicted = 1.014, the ratio the demo prints.
  const double ratio = static_cast<double>(r.saved_bytes) / static_cast<double>(predicted);
  EXPECT_NEAR(ratio, 1.014, 0.0005) << r.saved_bytes << " / " << predicted;

  // Where the bytes are, node by node (unit: one (B, T, d) fp32 tensor).
  const int64_t L = o.num_layers(), unit = 4 * kReferenceBatch * kReferenceSeqLen * o.d_model();
  const int64_t stats = 4 * kReferenceBatch * kReferenceSeqLen;  // one (B, T, 1) tensor
  EXPECT_EQ(node_bytes(r, "NativeLayerNormBackward0"), L * (2 * unit + 4 * stats));
  // (B, T, d) Linears run as mm on the flattened input plus a bias add.
  EXPECT_EQ(node_bytes(r, "MmBackward0"), L * 6 * unit);
  EXPECT_EQ(node_bytes(r, "GeluBackward0"), L * 4 * unit);
  EXPECT_EQ(node_bytes(r, "ScaledDotProductFlashAttentionForCpuBackward0"),
            L * (4 * unit + 4 * kReferenceBatch * o.num_heads() * kReferenceSeqLen));
  EXPECT_EQ(node_bytes(r, "PowBackward0"), unit);
  loss.backward();
}

} // namespace

namespace {

// The capstone's four variants (none, full, every_2, selective), metered,
// each asserted to the byte.
TEST(CapstoneTest, FourVariantsSaveExactlyWhatTheyShould) {
  torch::manual_seed(0);
  trainmem::TransformerOptions o;
  trainmem::Transformer model(o);
  auto x = torch::randn({kReferenceBatch, kReferenceSeqLen, o.d_model()});
  const int64_t L = o.num_layers();
  const int64_t unit = 4 * kReferenceBatch * kReferenceSeqLen * o.d_model();  // 512 KiB
  const int64_t extras = 4 * 4 * kReferenceBatch * kReferenceSeqLen            // LN mean, rstd x2
      + 4 * kReferenceBatch * o.num_heads() * kReferenceSeqLen;                // SDPA log-sum-exp
  ASSERT_EQ(unit, 512 * 1024);

  const auto none = trainmem::run_variant(model, x, trainmem::BlockCheckpointing::none(L));
  const auto full = trainmem::run_variant(model, x, trainmem::BlockCheckpointing::full(L));
  const auto every2 = trainmem::run_variant(model, x, trainmem::BlockCheckpointing::every(L, 2));
  const auto sel = trainmem::run_variant(
      model, x, trainmem::BlockCheckpointing::selective(L, trainmem::save_matmuls_policy()));

  EXPECT_EQ(none.saved.saved_bytes, (16 * L + 1) * unit + L * extras);
  EXPECT_EQ(full.saved.saved_bytes, (L + 1) * unit) << trainmem::to_string(full.saved);
  EXPECT_EQ(every2.saved.saved_bytes, (3 + 3 * 16 + 1) * unit + 3 * extras)
      << trainmem::to_string(every2.saved);
  EXPECT_EQ(sel.saved.saved_bytes, (L * 10 + 1) * unit) << trainmem::to_string(sel.saved);
  EXPECT_LT(full.saved.saved_bytes, every2.saved.saved_bytes);
  EXPECT_LT(every2.saved.saved_bytes, none.saved.saved_bytes);
  EXPECT_LE(sel.saved.saved_bytes, none.saved.saved_bytes);

  for (const auto* v : {&full, &every2, &sel}) {
    const double diff = trainmem::max_abs_diff(none.grads, v->grads);
    EXPECT_LT(diff, 1e-5) << v->name;
    std::cout << v->name << ": max grad diff " << diff << "\n";
  }
}

} // namespace

namespace {

// The demo prints a CPU peak for selective (68.4 MB) above none's
// (67.7 MB). Both are absolute live bytes, and when selective
// runs, the three earlier VariantRuns hold their gradient clones (3 x
// 4,758,528 B). What the step itself adds is well below none's; selective's
// own peak is in its forward (the cache's pre-bias copies beside the block's
// live locals, Note [In-place ops on cached outputs]), and a meta prediction
// of the same step gives it to within a few kB.
TEST(CapstoneTest, SelectivePeakIsBelowNonesOnceEarlierRunsAreNotCounted) {
  trainmem::CpuMemoryTracker::install();
  torch::manual_seed(0);
  trainmem::TransformerOptions o;
  trainmem::Transformer model(o);
  auto x = torch::randn({kReferenceBatch, kReferenceSeqLen, o.d_model()});
  const int64_t L = o.num_layers();
  std::vector<trainmem::VariantRun> runs;
  for (const auto& plan : trainmem::reference_variants(L)) {
    runs.push_back(trainmem::run_variant(model, x, plan));
  }
  const auto& none = runs[0];
  const auto& sel = runs[3];
  const int64_t held_by_earlier_runs = (sel.peak_bytes - sel.peak_above_start_bytes) -
      (none.peak_bytes - none.peak_above_start_bytes);
  std::cout << "none: peak " << none.peak_bytes << " B, above its start " << none.peak_above_start_bytes
            << " B\nselective: peak " << sel.peak_bytes << " B, above its start " << sel.peak_above_start_bytes
            << " B\nheld by the earlier runs when selective starts: " << held_by_earlier_runs << " B\n";
  EXPECT_EQ(held_by_earlier_runs, 3 * 4758528);
  EXPECT_LT(sel.peak_above_start_bytes, none.peak_above_start_bytes);
  EXPECT_LT(runs[1].peak_above_start_bytes, runs[2].peak_above_start_bytes);
  EXPECT_LT(runs[2].peak_above_start_bytes, none.peak_above_start_bytes);

  // The same step on meta: selective's peak is in its forward.
  trainmem::Transformer meta(o);
  trainmem::to_meta(*meta);
  const auto predicted = trainmem::predict_step_peak(*meta, [&] {
    return meta->forward(at::empty({kReferenceBatch, kReferenceSeqLen, o.d_model()}, at::kMeta),
                         trainmem::BlockCheckpointing::selective(L, trainmem::save_matmuls_policy()))
        .pow(2)
        .mean();
  });
  std::cout << trainmem::to_string(predicted);
  EXPECT_EQ(predicted.phase, trainmem::StepPhase::kForward);
  // run_variant's x exists before its window; the prediction builds it inside.
  const int64_t x_bytes = 4 * kReferenceBatch * kReferenceSeqLen * o.d_model();
  const int64_t measured = sel.peak_above_start_bytes + predicted.param_bytes + x_bytes;
  EXPECT_NEAR(static_cast<double>(predicted.peak_bytes), static_cast<double>(measured), 0.001 * measured);
}

} // namespace

namespace {

TEST(CapstoneTest, VariantsAreFoundByTheirNames) {
  for (const auto& v : trainmem::reference_variants(6)) {
    const auto n = trainmem::BlockCheckpointing::named(6, v.name);
    EXPECT_EQ(n.name, v.name);
    EXPECT_EQ(n.blocks, v.blocks) << v.name;
  }
  EXPECT_EQ(trainmem::BlockCheckpointing::named(6, "every_3").blocks,
            (std::vector<bool>{true, false, false, true, false, false}));
  for (const char* bad : {"every_", "every_0", "every_-1", "every_2x", "sqrt", ""}) {
    try {
      trainmem::BlockCheckpointing::named(6, bad);
      ADD_FAILURE() << "expected an error for \"" << bad << "\"";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find(std::string("but got \"") + bad + "\""), std::string::npos) << e.what();
    }
  }
}

} // namespace

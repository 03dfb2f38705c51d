#pragma once
/// \file block_checkpointing.h
/// Which blocks of a sequence of blocks are checkpointed, and how: the plan a
/// model's forward (Transformer::forward, run_regions()) takes and the
/// planner produces. Plain data with named constructors.
///
/// Example:
/// ```
/// auto plan = trainmem::BlockCheckpointing::every(6, 2);   // blocks 0, 2, 4
/// ```

#include <cstdint>
#include <string>
#include <vector>

#include "trainmem/export.h"
#include "trainmem/checkpoint.h"
#include "trainmem/selective.h"

namespace trainmem {

/// Which blocks (regions) of a sequence are checkpointed, and how: what
/// Transformer::forward and run_regions() take, and what a CheckpointPlan
/// gives (CheckpointPlan::checkpointing()). The four kinds are none(),
/// full(), every(k) and selective(policy).
///
/// Example:
/// ```
/// auto y = model->forward(x, trainmem::BlockCheckpointing::every(6, 2));
/// ```
struct TRAINMEM_API BlockCheckpointing {
  std::vector<bool> blocks;       ///< blocks[i]: checkpoint block i
  CheckpointOptions options;      ///< options of each checkpoint call
  /// Empty (every checkpointed block uses `options`), or one entry per block:
  /// the options of block i's checkpoint call (a selective policy per block).
  std::vector<CheckpointOptions> block_options;
  /// Empty (each checkpointed block is a region of its own), or one entry per
  /// block: region_length[i] = k > 1 checkpoints blocks i .. i + k - 1 as one
  /// region (blocks[i] must be set; the entries of the blocks it covers are
  /// ignored), so only block i's input is kept for all k (Chen et al.).
  std::vector<int64_t> region_length;
  std::string name = "none";      ///< "none", "full", "every_2", "selective"...

  /// The options block i is checkpointed with: block_options[i] when set,
  /// else `options`.
  const CheckpointOptions& options_for(int64_t i) const;
  /// Checkpoints block i selectively under `policy` (its cache holds what the
  /// policy saves; the rest is recomputed), leaving the other blocks as they
  /// are. Throws if i is out of range.
  BlockCheckpointing& set_block_policy(int64_t i, SelectivePolicy policy);

  /// No checkpointing.
  static BlockCheckpointing none(int64_t num_layers);
  /// Every block.
  static BlockCheckpointing full(int64_t num_layers);
  /// Blocks 0, k, 2k, ... (every_2 checkpoints every other block).
  static BlockCheckpointing every(int64_t num_layers, int64_t k);
  /// Every block, selectively: `policy`'s saved op outputs are cached.
  static BlockCheckpointing selective(int64_t num_layers, SelectivePolicy policy);
  /// The given blocks.
  static BlockCheckpointing chosen(int64_t num_layers, const std::vector<int64_t>& which);
  /// checkpoint_sequential's split: `num_segments` runs of L / num_segments
  /// consecutive blocks (the last takes the rest), all but the last
  /// checkpointed as one region each. Throws unless 1 <= num_segments <= L.
  static BlockCheckpointing segments(int64_t num_layers, int64_t num_segments);
  /// segments(L, sqrt_segments(L)): Chen et al.'s sqrt(L) rule.
  static BlockCheckpointing sqrt(int64_t num_layers);
  /// The variant a name gives: "none", "full", "every_<k>" (k >= 1) or
  /// "selective" (save matmuls), the names the other constructors set.
  /// Throws c10::Error naming `name` otherwise.
  static BlockCheckpointing named(int64_t num_layers, const std::string& name);
};

} // namespace trainmem

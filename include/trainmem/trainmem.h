#pragma once
/// \file trainmem.h
/// Umbrella header: everything trainmem offers. Prefer the concept headers in
/// your own code (they compile faster).

#include "trainmem/accountant.h"
#include "trainmem/allocator.h"
#include "trainmem/audit.h"
#include "trainmem/checkpoint.h"
#include "trainmem/cuda_allocator_model.h"
#include "trainmem/cuda_predict.h"
#include "trainmem/device.h"
#include "trainmem/format.h"
#include "trainmem/gpt.h"
#include "trainmem/grad_scaler.h"
#include "trainmem/hf_model.h"
#include "trainmem/hooks.h"
#include "trainmem/meta.h"
#include "trainmem/meter.h"
#include "trainmem/offload.h"
#include "trainmem/optimizer_in_backward.h"
#include "trainmem/planner.h"
#include "trainmem/report.h"
#include "trainmem/selective.h"
#include "trainmem/snapshot.h"
#include "trainmem/timeline.h"
#include "trainmem/trainer.h"
#include "trainmem/transformer.h"
#include "trainmem/version.h"

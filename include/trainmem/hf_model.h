#pragma once
/// \file hf_model.h
/// Moved to trainmem/models/hf_model.h (the models layer); this forwarding header
/// is kept for one release.
#include "trainmem/models/hf_model.h"

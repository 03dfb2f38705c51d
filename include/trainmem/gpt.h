#pragma once
/// \file gpt.h
/// Moved to trainmem/models/gpt.h (the models layer); this forwarding header
/// is kept for one release.
#include "trainmem/models/gpt.h"

#pragma once
/// \file transformer.h
/// Moved to trainmem/models/transformer.h (the models layer); this forwarding header
/// is kept for one release.
#include "trainmem/models/transformer.h"

# A LibTorch that claims a version trainmem was not built against
# (install.torch_mismatch): new enough for any floor, never the same minor.
set(PACKAGE_VERSION "99.0.0")
set(PACKAGE_VERSION_COMPATIBLE TRUE)

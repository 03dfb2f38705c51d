// Proves the one fmt we use (the torch wheel's headers, header-only) compiles,
// links and formats: see docs/design.md, Note [One fmt].
#include <fmt/format.h>

#include <gtest/gtest.h>

TEST(FmtTest, FormatsWithTheHeadersWeCompileAgainst) {
  EXPECT_EQ(fmt::format("{:>8}|{:.3f}|{}", 42, 1.0146, "B"), "      42|1.015|B");
  EXPECT_GE(FMT_VERSION, 100000);  // fmt 10 or newer, as the wheel ships
}

// The node log's level (node.log-level): lines below it are not written.
#include <gtest/gtest.h>

#include <string>

#include "actors/log.h"

namespace disagg {
namespace {

std::string logged_at(LogLevel setting, LogLevel level, const std::string& line) {
  set_node_log_level(setting);
  ::testing::internal::CaptureStderr();
  node_log(level, line);
  const std::string out = ::testing::internal::GetCapturedStderr();
  set_node_log_level(LogLevel::info);
  return out;
}

TEST(NodeLog, LinesBelowTheLevelAreNotWritten) {
  EXPECT_NE(logged_at(LogLevel::info, LogLevel::info, "registered x").find("registered x"), std::string::npos);
  EXPECT_EQ(logged_at(LogLevel::warning, LogLevel::info, "registered x"), "");
  EXPECT_NE(logged_at(LogLevel::warning, LogLevel::warning, "request 7 failed").find("request 7 failed"),
            std::string::npos);
  EXPECT_EQ(logged_at(LogLevel::error, LogLevel::warning, "request 7 failed"), "");
  EXPECT_NE(logged_at(LogLevel::error, LogLevel::error, "lost worker y").find("lost worker y"), std::string::npos);
}

TEST(NodeLog, LevelsParseByName) {
  LogLevel level = LogLevel::info;
  EXPECT_TRUE(parse_log_level("error", &level));
  EXPECT_EQ(level, LogLevel::error);
  EXPECT_TRUE(parse_log_level("warning", &level));
  EXPECT_EQ(level, LogLevel::warning);
  EXPECT_TRUE(parse_log_level("info", &level));
  EXPECT_EQ(level, LogLevel::info);
  EXPECT_FALSE(parse_log_level("loud", &level));
}

}  // namespace
}  // namespace disagg

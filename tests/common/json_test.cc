#include "common/json.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace pskv {
namespace {

TEST(JsonObject, FieldsInOrderWithEveryKindOfValue) {
  const std::vector<std::int64_t> clocks{3, -1, 0};
  JsonObject j;
  j.add("n", std::uint64_t{18446744073709551615ull})
      .add("neg", -7)
      .add("yes", true)
      .add("ratio", 0.25)
      .add("fixed", 2.0 / 3.0, 2)
      .add("name", "tcp")
      .add("clocks", std::span<const std::int64_t>(clocks));
  EXPECT_EQ(
      j.str(),
      R"({"n":18446744073709551615,"neg":-7,"yes":true,"ratio":0.25,"fixed":0.67,"name":"tcp","clocks":[3,-1,0]})");
}

TEST(JsonObject, StringsAreEscapedAndNonFiniteNumbersAreNull) {
  JsonObject j;
  j.add("s", std::string_view("a\"b\\c\nd\x01", 8))
      .add("nan", std::nan(""))
      .add("inf", std::numeric_limits<double>::infinity());
  EXPECT_EQ(j.str(), R"({"s":"a\"b\\c\nd\u0001","nan":null,"inf":null})");
}

TEST(JsonObject, ShortestDoubleReadsBackExactly) {
  const double x = 0.1 + 0.2;
  JsonObject j;
  j.add("x", x);
  const std::string s = j.str();
  EXPECT_EQ(std::stod(s.substr(5, s.size() - 6)), x) << s;
}

TEST(JsonObject, MergeKeepsOneFlatObject) {
  JsonObject a, b, empty;
  a.add("a", 1);
  b.add("b", 2);
  EXPECT_EQ(JsonObject().merge(empty).str(), "{}");
  EXPECT_EQ(a.merge(empty).merge(b).str(), R"({"a":1,"b":2})");
  EXPECT_EQ(JsonObject().merge(b).str(), R"({"b":2})");
}

TEST(AbridgeArrays, ALongArrayIsCutAndItsLengthFollowsIt) {
  JsonObject j;
  const std::vector<std::int64_t> many{1, 2, 3, 4, 5}, few{7, 8};
  j.add("a", 1).add("clocks", std::span<const std::int64_t>(many)).add("few", std::span<const std::int64_t>(few));
  j.add("note", "[1,2,3,4] \"quoted\"").add("none", std::span<const std::int64_t>()).add("z", 2);
  EXPECT_EQ(abridge_arrays(j.str(), 3),
            R"({"a":1,"clocks":[1,2,3],"clocks_length":5,"few":[7,8],"note":"[1,2,3,4] \"quoted\"","none":[],"z":2})");
  EXPECT_EQ(abridge_arrays(j.str(), 5), j.str());
  EXPECT_EQ(abridge_arrays(R"({"c":[1,2],"d":[]})", 0), R"({"c":[],"c_length":2,"d":[]})");
  EXPECT_EQ(abridge_arrays(R"({"x":[1,2)", 1), R"({"x":[1,2)");  // not JsonObject's: left alone
}

}  // namespace
}  // namespace pskv

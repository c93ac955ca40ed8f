// A retrying client's push identities (src/client/push_sequence.h): the session is replaced past
// 2^30 pushes at the first moment none of the old session's may be sent again, and past 2^31
// without such a moment pushes are refused, so a sequence number never wraps onto a mark.
#include "client/push_sequence.h"

#include <gtest/gtest.h>

#include "support/errors.h"

namespace pskv::detail {
namespace {

TEST(PushSequence, NumbersPushesOneByOneInOneNonzeroSession) {
  PushSequence p;
  const std::uint32_t session = p.session();
  EXPECT_NE(session, 0u);
  for (std::uint32_t i = 1; i <= 100; ++i) EXPECT_EQ(p.next([] { return true; }), i);
  EXPECT_EQ(p.session(), session);
}

TEST(PushSequence, PastTwoToTheThirtyANewSessionStartsOnceNothingMayBeSentAgain) {
  PushSequence p(PushSequence::kRotateSeq - 1);
  const std::uint32_t first = p.session();
  int asked = 0;
  // Below the threshold nobody asks whether earlier pushes may be sent again.
  EXPECT_EQ(p.next([&] { return ++asked, false; }), PushSequence::kRotateSeq);
  EXPECT_EQ(asked, 0);
  // Past it, not while some may be.
  EXPECT_EQ(p.next([&] { return ++asked, true; }), PushSequence::kRotateSeq + 1);
  EXPECT_EQ(asked, 1);
  EXPECT_EQ(p.session(), first);
  // Then at the first moment none may: a new session, numbered from 1.
  EXPECT_EQ(p.next([] { return false; }), 1u);
  EXPECT_NE(p.session(), first);
  EXPECT_NE(p.session(), 0u);
}

TEST(PushSequence, PastTwoToTheThirtyOneWithoutSuchAMomentPushesAreRefused) {
  PushSequence p(PushSequence::kLastSeq - 1);
  const std::uint32_t session = p.session();
  EXPECT_EQ(p.next([] { return true; }), PushSequence::kLastSeq);
  testing::expect_error([&] { p.next([] { return true; }); }, Errc::capacity, {"2^31", "wait()"});
  // Refused, not consumed: once the old ones are answered the next push starts a new session.
  EXPECT_EQ(p.next([] { return false; }), 1u);
  EXPECT_NE(p.session(), session);
}

}  // namespace
}  // namespace pskv::detail

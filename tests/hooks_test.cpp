#include "trainmem/hooks.h"

#include <atomic>
#include <stdexcept>
#include <thread>

#include <gtest/gtest.h>
#include <ATen/ATen.h>

namespace {

// A hooks object that counts calls and keeps tensors as they are.
struct CountingHooks : trainmem::SavedTensorHooks {
  std::atomic<int> packs{0};
  std::atomic<int> unpacks{0};
  std::any pack(const at::Tensor& t) override {
    ++packs;
    return t.tensor_data();
  }
  at::Tensor unpack(const std::any& p) override {
    ++unpacks;
    return std::any_cast<at::Tensor>(p);
  }
};

// x -> sin(x) * w: sin saves x, mul saves sin(x) and w: 3 saved tensors.
at::Tensor small_graph(const at::Tensor& x, const at::Tensor& w) {
  return (x.sin() * w).sum();
}

TEST(HooksTest, EngineIsInstalled) {
  EXPECT_TRUE(trainmem::saved_tensor_hooks_available());
  EXPECT_EQ(trainmem::num_active_saved_tensor_hooks(), 0);
}

TEST(HooksTest, PackAndUnpackSeeEverySavedTensor) {
  auto x = at::randn({4, 3}).requires_grad_();
  auto w = at::randn({4, 3}).requires_grad_();
  auto hooks = std::make_shared<CountingHooks>();
  at::Tensor loss;
  {
    trainmem::SavedTensorHooksGuard guard(hooks);
    loss = small_graph(x, w);
  }
  EXPECT_EQ(hooks->packs.load(), 3);
  EXPECT_EQ(hooks->unpacks.load(), 0);
  loss.backward();
  EXPECT_EQ(hooks->unpacks.load(), 3);
  EXPECT_TRUE(x.grad().equal(x.cos() * w));
  EXPECT_TRUE(w.grad().equal(x.sin()));
}

TEST(HooksTest, InnermostPairApplies) {
  auto x = at::randn({5}).requires_grad_();
  auto outer = std::make_shared<CountingHooks>();
  auto inner = std::make_shared<CountingHooks>();
  at::Tensor a, b, c;
  {
    trainmem::SavedTensorHooksGuard g1(outer);
    a = x.exp();  // exp saves its result: 1
    {
      trainmem::SavedTensorHooksGuard g2(inner);
      EXPECT_EQ(trainmem::num_active_saved_tensor_hooks(), 2);
      b = x.sin();  // 1
      b = b.cos();  // 1
    }
    c = x.tanh();  // 1
  }
  EXPECT_EQ(outer->packs.load(), 2);
  EXPECT_EQ(inner->packs.load(), 2);
  EXPECT_EQ(trainmem::num_active_saved_tensor_hooks(), 0);
}

TEST(HooksTest, LambdaHooksTransformSavedTensors) {
  // Pack stores a double copy, unpack converts back: gradients still exact
  // because the float -> double -> float round trip is lossless.
  auto x = at::randn({8}).requires_grad_();
  int packs = 0;
  at::Tensor loss;
  {
    trainmem::SavedTensorHooksGuard guard(
        [&](const at::Tensor& t) -> std::any {
          ++packs;
          return t.to(at::kDouble);
        },
        [](const std::any& p) { return std::any_cast<at::Tensor>(p).to(at::kFloat); });
    loss = x.pow(3).sum();
  }
  loss.backward();
  EXPECT_EQ(packs, 1);  // pow saves self (the exponent is a scalar)
  EXPECT_TRUE(x.grad().equal(3 * x.pow(2)));
}

TEST(HooksTest, UnpackRunsOnAnotherThreadAfterScopeEnded) {
  auto x = at::randn({16}).requires_grad_();
  auto hooks = std::make_shared<CountingHooks>();
  at::Tensor loss;
  {
    trainmem::SavedTensorHooksGuard guard(hooks);
    loss = x.exp().sum();
  }
  std::weak_ptr<CountingHooks> weak = hooks;
  auto* raw = hooks.get();
  hooks.reset();  // the packed tensor keeps the hooks object alive
  ASSERT_FALSE(weak.expired());
  int unpacks_seen = -1;
  std::thread t([&] {
    auto grad_fn = loss.grad_fn();
    loss.backward(/*gradient=*/{}, /*retain_graph=*/true);
    unpacks_seen = raw->unpacks.load();  // still alive: the graph is retained
  });
  t.join();
  EXPECT_EQ(unpacks_seen, 1);
  EXPECT_TRUE(x.grad().equal(x.exp()));
  loss = at::Tensor();  // freeing the graph frees the hooks object
  EXPECT_TRUE(weak.expired());
}

TEST(HooksTest, HooksAreThreadLocal) {
  auto hooks = std::make_shared<CountingHooks>();
  trainmem::SavedTensorHooksGuard guard(hooks);
  std::thread t([] {
    EXPECT_EQ(trainmem::num_active_saved_tensor_hooks(), 0);
    auto y = at::randn({3}).requires_grad_().exp();
    (void)y;
  });
  t.join();
  EXPECT_EQ(hooks->packs.load(), 0);
}

TEST(HooksTest, ExceptionInForwardLeavesNoHooks) {
  auto hooks = std::make_shared<CountingHooks>();
  auto x = at::randn({2, 3}).requires_grad_();
  EXPECT_THROW(
      {
        trainmem::SavedTensorHooksGuard guard(hooks);
        auto y = x.exp();
        (void)y;
        (void)at::mm(x, x);  // (2,3) @ (2,3): throws
      },
      c10::Error);
  EXPECT_EQ(trainmem::num_active_saved_tensor_hooks(), 0);
  const int packs = hooks->packs.load();
  EXPECT_GE(packs, 1);
  auto z = x.exp();  // no hooks any more: not packed
  (void)z;
  EXPECT_EQ(hooks->packs.load(), packs);
}

TEST(HooksTest, DisableGuardSuspendsHooksAndRejectsNewOnes) {
  auto hooks = std::make_shared<CountingHooks>();
  auto x = at::randn({3}).requires_grad_();
  trainmem::SavedTensorHooksGuard guard(hooks);
  {
    trainmem::DisableSavedTensorHooksGuard off("offload does not support this region");
    auto y = x.exp();
    (void)y;
    EXPECT_EQ(hooks->packs.load(), 0);
    try {
      trainmem::SavedTensorHooksGuard again(std::make_shared<CountingHooks>());
      FAIL() << "installing hooks inside a disabled region must throw";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("offload does not support this region"),
                std::string::npos) << e.what();
    }
  }
  auto z = x.exp();
  (void)z;
  EXPECT_EQ(hooks->packs.load(), 1);
}

TEST(HooksTest, RejectsNullHooks) {
  try {
    trainmem::SavedTensorHooksGuard guard(std::shared_ptr<trainmem::SavedTensorHooks>{});
    FAIL();
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("hooks must not be null"), std::string::npos);
  }
  EXPECT_THROW(trainmem::SavedTensorHooksGuard(nullptr, [](const std::any&) { return at::Tensor(); }),
               c10::Error);
  EXPECT_EQ(trainmem::num_active_saved_tensor_hooks(), 0);
}

TEST(HooksTest, GuardDestroyedOnAnotherThreadIsDropped) {
  auto hooks = std::make_shared<CountingHooks>();
  auto guard = std::make_unique<trainmem::SavedTensorHooksGuard>(hooks);
  EXPECT_EQ(trainmem::num_active_saved_tensor_hooks(), 1);
  std::thread t([&] { guard.reset(); });  // warns, never throws
  t.join();
  EXPECT_EQ(trainmem::num_active_saved_tensor_hooks(), 0);
  auto y = at::randn({3}).requires_grad_().exp();
  (void)y;
  EXPECT_EQ(hooks->packs.load(), 0);
}

TEST(HooksTest, WrappedNumbersAreNotPacked) {
  // Scalars autograd wraps into tensors never reach pack (as in PyTorch).
  auto hooks = std::make_shared<CountingHooks>();
  auto x = at::randn({3}).requires_grad_();
  trainmem::SavedTensorHooksGuard guard(hooks);
  auto two = at::scalar_tensor(2.0, at::kFloat);
  auto y = at::mul(x, two);  // MulBackward0 saves `other`: packed
  EXPECT_EQ(hooks->packs.load(), 1);
  two.unsafeGetTensorImpl()->set_wrapped_number(true);
  auto z = at::mul(x, two);  // the same, wrapped: saved without a hook
  EXPECT_EQ(hooks->packs.load(), 1);
  (void)y;
  (void)z;
}

} // namespace

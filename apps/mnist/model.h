// The models a pskv worker trains: a dense MLP (the default) and the seed's CNN, with forward
// and backward passes on the CPU (Eigen for the math, oneTBB to split a batch across threads).
//
// Parameters are exposed for a parameter-server client to move without copies: each tensor is
// one ParamBlock whose value and gradient buffers the model owns, at fixed addresses for the
// model's lifetime, 64-byte aligned. The forward pass reads `value` directly, so a pull into
// `value` is all it takes to update the weights; forward_backward leaves the gradient in `grad`,
// ready to be pushed. One PS key per block. All value buffers are slices of one allocation, in
// block order, and so are all gradient buffers: one RDMA registration can cover each.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace pskv::mnist {

// Names and layouts follow PyTorch's state_dict: "fc1.weight" is [out][in] row-major, a conv
// weight is [out_channels][in_channels][kh][kw]; biases are separate blocks.
struct ParamBlock {
  std::string name;
  float* value;
  float* grad;
  std::size_t size;  // floats
};

// Thread-safety: none. One thread drives a model at a time; the model runs its own worker
// threads inside forward_backward and count_correct and they are finished on return. Parameter
// values may be rewritten (a pull) between calls, never during one.
class Model {
 public:
  virtual ~Model() = default;

  virtual std::string_view name() const noexcept = 0;

  // Same blocks, same order, same addresses on every call.
  virtual std::vector<ParamBlock> params() = 0;
  std::size_t param_count();

  // Random weights (mlp: He-uniform hidden layers, Glorot-uniform output, zero biases; cnn:
  // PyTorch's default init, as the seed had), and reseeds dropout. Deterministic in `seed`.
  // Workers that then pull their weights from a server should pass different seeds (e.g.
  // seed + rank) so that their dropout masks differ.
  virtual void init(std::uint64_t seed) = 0;

  // 28x28 images with pixels in [0,1], batch of them back to back, labels 0..9. Returns the mean
  // negative log-likelihood and overwrites every grad buffer with the gradient of that mean.
  // Each call in training mode draws fresh dropout masks. Throws pskv::Error on a bad argument.
  virtual float forward_backward(const float* images, const std::uint8_t* labels, std::size_t batch) = 0;

  // Number of the n samples whose arg-max prediction equals the label. Always without dropout,
  // whatever set_training says; processes large n in slices, so a whole test set can be passed.
  virtual std::size_t count_correct(const float* images, const std::uint8_t* labels, std::size_t n) = 0;

  // Dropout in forward_backward on (the default) or off. Models without dropout ignore it.
  virtual void set_training(bool training) = 0;
};

// Both models first standardise pixels with MNIST's mean and deviation (0.1307, 0.3081), as the
// seed's input transform does; the data set itself stays in [0,1].
// "mlp": 784 -> 256 -> ReLU -> 128 -> ReLU -> 10 -> log-softmax (235,146 parameters): 97.6%
//        test accuracy on MNIST after 2 epochs of plain SGD, lr 0.1, batch 32.
// "cnn": the seed's network (1,201,382 parameters); see model.cc for its layer list.
// threads >= 1 splits each batch over that many threads; 1 runs on the caller's thread only.
// The model comes initialised with init(0). Throws pskv::Error for an unknown name or threads < 1.
std::unique_ptr<Model> make_model(std::string_view name, int threads);

// One local SGD step: forward_backward, then value -= lr * grad for every block. Returns the loss.
float sgd_step(Model& model, const float* images, const std::uint8_t* labels, std::size_t batch, float lr);

}  // namespace pskv::mnist

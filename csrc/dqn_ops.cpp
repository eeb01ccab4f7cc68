// Every schema of the package, in one block. Kernels register per backend:
// csrc/*_cpu.cpp (CPU reference) and csrc/cuda/*.cu (CUDA). Fake (meta) kernels and autograd
// formulas are registered from Python, beside the wrappers (dqn_ops/ops.py).
//
// How to add an op:
//   1. its schema here (mutable arguments as Tensor(a!), documented below);
//   2. argument checks shared by both backends in a csrc/*_args.h header (and nowhere else);
//   3. the CPU reference kernel in csrc/, the CUDA kernel in csrc/cuda/ (one .cu per op family:
//      setup.py compiles csrc/cuda/*.cu; a .cu's private parts go in csrc/cuda/<family>/*.cuh);
//   4. in dqn_ops/ops.py: a typed wrapper, register_fake, and register_autograd if differentiable;
//   5. tests/test_<op>.py: reference comparison, opcheck, bad inputs, CUDA graph + no-sync on GPU.
// A limit the Python side must know is a constant in a C++ header, exported below (PyInit__C).
#include <Python.h>
#include <torch/library.h>

#include "act_args.h"
#include "dense_layer_mode.h"
#include "fused_loss_limits.h"
#include "iqn_fractions_args.h"
#include "loss_args.h"
#include "side_streams.h"
#include "spectral_args.h"
#ifdef DQN_OPS_WITH_CUDA
#include <c10/cuda/CUDAFunctions.h>

#include "cuda/side_stream.h"
#endif

// `import dqn_ops._C` loads this library, whose static initialisers register the ops. The
// module also carries the limits the Python side chooses a path by:
//   FUSED_LOSS_MAX_ATOMS, FUSED_LOSS_MAX_BRANCHES: the most atoms (C51) and branches (C51, QR)
//     with which _dqn_loss_on_logits runs as the single fused kernel on CUDA (csrc/fused_loss_limits.h);
//   LOSS_CUDA_MAX_ATOMS: the most atoms (C51) or quantiles (QR) the CUDA loss takes (csrc/loss_args.h);
//   IQN_MAX_FRACTIONS: the most fractions per row of each set iqn_fractions draws (csrc/iqn_fractions_args.h);
//   EPSILON_GREEDY_MAX_BRANCHES, EPSILON_GREEDY_MAX_ACTIONS: epsilon_greedy's limits (csrc/act_args.h);
// the side streams (csrc/side_streams.h; dqn_ops/side_stream.py wraps them):
//   _side_streams_enabled() -> bool, _set_side_streams(bool) -> the previous setting;
//   _side_stream(device index, current stream as an int, lane >= 1) -> the side stream of that
//     device, stream and lane for the calling thread, as an int (csrc/cuda/side_stream.h; lane 0
//     is the ops' own); RuntimeError in a build without the CUDA kernels;
// the dense layer kernel's switch (csrc/dense_layer_mode.h; dqn_ops/dense_kernel.py wraps it):
//   _dense_layer_mode() -> "auto" | "on" | "off", _set_dense_layer_mode(name) -> the previous name;
// and one test hook, not part of the API:
//   _set_spectral_strategy(name) -> previous name: "auto" (the default) or "cooperative" (every
//     matrix of batched_spectral_norm on CUDA takes the cooperative strategy; csrc/spectral_args.h).
namespace {
// A c10::Error (an invalid DQN_OPS_* setting, a failed CUDA call) as a Python RuntimeError.
template <class F>
PyObject* raising_runtime_error(F&& f) {
  try {
    return f();
  } catch (const c10::Error& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what_without_backtrace());
    return nullptr;
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
}

PyObject* side_streams_enabled_py(PyObject* /*self*/, PyObject* /*args*/) {
  return raising_runtime_error([] { return PyBool_FromLong(dqn_ops::side_streams_enabled()); });
}

PyObject* set_side_streams_py(PyObject* /*self*/, PyObject* args) {
  int on = 0;
  if (!PyArg_ParseTuple(args, "p", &on)) return nullptr;
  return raising_runtime_error([on] { return PyBool_FromLong(dqn_ops::set_side_streams(on != 0)); });
}

PyObject* side_stream_py(PyObject* /*self*/, PyObject* args) {
  int device = 0, lane = 0;
  PyObject* stream = nullptr;
  if (!PyArg_ParseTuple(args, "iO!i", &device, &PyLong_Type, &stream, &lane)) return nullptr;
  const unsigned long long current = PyLong_AsUnsignedLongLong(stream);  // OverflowError if negative
  if (PyErr_Occurred()) return nullptr;
  if (lane < 1) {
    PyErr_SetString(PyExc_ValueError, "_side_stream: lane must be >= 1 (lane 0 is the ops' own)");
    return nullptr;
  }
#ifdef DQN_OPS_WITH_CUDA
  return raising_runtime_error([&] {
    const int count = static_cast<int>(c10::cuda::device_count());
    DQN_CHECK(device >= 0 && device < count, "_side_stream: device index ", device, " is not one of the ", count,
              " CUDA devices");
    const dqn_ops::cuda::SideStreamSlot slot = dqn_ops::cuda::side_stream_slot(
        static_cast<c10::DeviceIndex>(device), reinterpret_cast<cudaStream_t>(static_cast<uintptr_t>(current)), lane);
    return PyLong_FromUnsignedLongLong(static_cast<unsigned long long>(reinterpret_cast<uintptr_t>(slot.stream)));
  });
#else
  PyErr_SetString(PyExc_RuntimeError, "_side_stream: dqn_ops was built without its CUDA kernels");
  return nullptr;
#endif
}

PyObject* dense_layer_mode_py(PyObject* /*self*/, PyObject* /*args*/) {
  return raising_runtime_error(
      [] { return PyUnicode_FromString(dqn_ops::dense_layer_mode_name(dqn_ops::dense_layer_mode())); });
}

PyObject* set_dense_layer_mode_py(PyObject* /*self*/, PyObject* args) {
  const char* name = nullptr;
  if (!PyArg_ParseTuple(args, "s", &name)) return nullptr;
  dqn_ops::DenseLayerMode mode;
  if (!dqn_ops::parse_dense_layer_mode(name, &mode)) {
    PyErr_SetString(PyExc_ValueError,
                    ("_set_dense_layer_mode: expected " + dqn_ops::dense_layer_mode_choices() + ", got '" + name + "'")
                        .c_str());
    return nullptr;
  }
  // Raises when DQN_OPS_DENSE_KERNEL holds an unknown value.
  return raising_runtime_error([mode] {
    return PyUnicode_FromString(dqn_ops::dense_layer_mode_name(dqn_ops::set_dense_layer_mode(mode)));
  });
}

PyObject* set_spectral_strategy_py(PyObject* /*self*/, PyObject* args) {
  const char* name = nullptr;
  if (!PyArg_ParseTuple(args, "s", &name)) return nullptr;
  dqn_ops::SpectralStrategy strategy;
  if (!dqn_ops::parse_spectral_strategy(name, &strategy)) {
    PyErr_SetString(PyExc_ValueError,
                    ("_set_spectral_strategy: expected " + dqn_ops::spectral_strategy_choices() + ", got '" + name + "'")
                        .c_str());
    return nullptr;
  }
  // Raises when DQN_OPS_SPECTRAL_STRATEGY holds an unknown name.
  return raising_runtime_error([strategy] {
    return PyUnicode_FromString(dqn_ops::spectral_strategy_name(dqn_ops::set_spectral_strategy(strategy)));
  });
}
}  // namespace

extern "C" {
PyObject* PyInit__C(void) {
  static PyMethodDef methods[] = {
      {"_side_streams_enabled", side_streams_enabled_py, METH_NOARGS,
       "Whether the ops and steps run independent work on side streams (dqn_ops.side_stream)."},
      {"_set_side_streams", set_side_streams_py, METH_VARARGS,
       "Turns the side streams on or off for the process; returns the previous setting."},
      {"_side_stream", side_stream_py, METH_VARARGS,
       "The side stream (an int cudaStream_t) of (device index, current stream, lane >= 1) for this thread."},
      {"_dense_layer_mode", dense_layer_mode_py, METH_NOARGS,
       "Which dense hidden layers the CUDA forward runs with its own GEMM kernel: 'auto', 'on' or 'off'."},
      {"_set_dense_layer_mode", set_dense_layer_mode_py, METH_VARARGS,
       "Sets the dense layer kernel's mode ('auto', 'on' or 'off') for the process; returns the previous one."},
      {"_set_spectral_strategy", set_spectral_strategy_py, METH_VARARGS,
       "Test hook: batched_spectral_norm's CUDA strategy, 'auto' or 'cooperative'; returns the previous one."},
      {nullptr, nullptr, 0, nullptr}};
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, methods};
  PyObject* module = PyModule_Create(&module_def);
  if (module == nullptr) return nullptr;
  if (PyModule_AddIntConstant(module, "FUSED_LOSS_MAX_ATOMS", dqn_ops::kFusedLossMaxAtoms) < 0 ||
      PyModule_AddIntConstant(module, "FUSED_LOSS_MAX_BRANCHES", dqn_ops::kFusedLossMaxBranches) < 0 ||
      PyModule_AddIntConstant(module, "LOSS_CUDA_MAX_ATOMS", dqn_ops::kLossCudaMaxAtoms) < 0 ||
      PyModule_AddIntConstant(module, "IQN_MAX_FRACTIONS", dqn_ops::kIqnMaxFractions) < 0 ||
      PyModule_AddIntConstant(module, "EPSILON_GREEDY_MAX_BRANCHES", dqn_ops::kEpsilonGreedyMaxBranches) < 0 ||
      PyModule_AddIntConstant(module, "EPSILON_GREEDY_MAX_ACTIONS", dqn_ops::kEpsilonGreedyMaxActions) < 0) {
    Py_DECREF(module);
    return nullptr;
  }
  return module;
}
}

TORCH_LIBRARY(dqn_ops, m) {
  // states [B, SD] -> q_logits [B, sum n_d, NA] (dueling-aggregated; without dueling the branch
  // heads' outputs), head_logits [B, NA*(dueling + sum n_d)] (raw value logits, then each
  // branch's), and the activations the backward reads: the states and every hidden layer at the
  // mirror's precision (BF16 on CUDA), L + H + 1 tensors (dqn_ops/layout.py). backward_precision
  // is read only by autograd (it chooses mixed_backward's precision) and is validated here.
  // An IQN network (docs/iqn-design.md) takes fractions [B, N], each sample's quantile
  // fractions: q_logits [B, E * sum n_d, N] (slot i: the value at fraction i), head_logits
  // [B * N, ...] (row b * N + i), and the activations gain the cosines, phi and z after the trunk
  // (L + H + 4 tensors, those from the cosines on B * N rows).
  m.def(
      "bf16_dueling_forward(Tensor states, Tensor params, Tensor params_bf16, int[] layout, "
      "str backward_precision=\"tf32\", Tensor? fractions=None) -> (Tensor q_logits, Tensor head_logits, "
      "Tensor[] activations)");
  // d(q_logits) and/or d(head_logits) -> the flat gradient (every dW and db, in the layout of
  // params, padding zero) and, when need_grad_states, d(states) [B, SD] (else an empty tensor).
  m.def(
      "mixed_backward(Tensor? grad_q, Tensor? grad_head, Tensor[] activations, Tensor params, "
      "Tensor params_bf16, int[] layout, str precision=\"tf32\", "
      "bool need_grad_states=False) -> (Tensor grad_params, Tensor grad_states)");
  // One Adam (AdamW when decoupled_weight_decay) step over a flat F32 buffer that also writes
  // its BF16 mirror. step and lr are one-element device tensors, so a captured graph replays
  // with a changing lr and step. grad_norm receives the global gradient norm (before
  // clipping; its sum of squares accumulates in double on both backends, so a huge but finite
  // gradient has a finite norm); max_grad_norm clips to it. A non-finite norm, or an lr that is
  // NaN, infinite or negative (a device tensor: checked on the device, no host read), skips the
  // step on the device (params, moments, mirror and step unchanged) and sets found_inf to 1
  // (else 0). No two arguments may share memory.
  m.def(
      "fused_adam_bf16(Tensor(a!) params, Tensor grads, Tensor(b!) exp_avg, Tensor(c!) exp_avg_sq, "
      "Tensor(d!) params_bf16, Tensor(e!) step, Tensor lr, float beta1, float beta2, float eps, "
      "float weight_decay, bool decoupled_weight_decay, float? max_grad_norm, Tensor(f!) grad_norm, "
      "Tensor(g!) found_inf) -> ()");
  // Polyak averaging target = lerp(target, online, tau), writing the target's BF16 mirror in the same pass.
  m.def("ema_update(Tensor(a!) target, Tensor(b!) target_bf16, Tensor online, float tau) -> ()");
  // Deferred readback (dqn_ops/readback.py): ring[slot] = values (one-element F32 tensors, one
  // per ring column), slot = (slot + 1) % rows, flag = max(flag, non_finite); all on the device;
  // host_flag (a CPU tensor, pinned for CUDA) receives the new flag too, written by the kernel:
  // it must outlive the launch (and any CUDA graph that captured it), since pinned memory's
  // cache does not know the kernel writes it.
  m.def("record_step(Tensor(a!) ring, Tensor(b!) slot, Tensor(c!) flag, Tensor[] values, Tensor non_finite, "
        "Tensor(d!)? host_flag=None) -> ()");
  // Internal (the trainer's load_batch): dst[i] <- src[i] for up to 8 pairs of one dtype and
  // size each, in one launch on CUDA.
  m.def("_load_batch(Tensor(a!)[] dst, Tensor[] src) -> ()");
  // Spectral norm of every weight matrix at once: n_power_iterations of power iteration from
  // each matrix's persistent u / v (updated in place), sigma[m] = the estimate of its largest
  // singular value, then W <- W * min(1, sigma_max[m] / sigma[m]) in params, with the rescaled
  // rows rewritten in params_bf16. matrices: (offset, rows, cols) per matrix in params (see
  // csrc/spectral_args.h). One kernel launch for all of them; one_launch_per_matrix runs the
  // same kernel once per matrix instead (the equivalence test's reference).
  m.def(
      "batched_spectral_norm(Tensor(a!) params, Tensor(b!) params_bf16, Tensor(c!) u, Tensor(d!) v, "
      "Tensor(e!) sigma, int[] matrices, float[] sigma_max, int n_power_iterations=1, float eps=1e-12, "
      "bool one_launch_per_matrix=False) -> ()");
  // The DQN loss on q logits [B, E * sum n_d, atoms] (bf16_dueling_forward's q_logits) (q: online on s;
  // q_next_online: online on s', which picks the next action per branch (double DQN);
  // q_next_target: target on s'). E >= 1 ensemble members, inferred from q's width (a positive
  // multiple of sum n_d, else an error): member e's branch d at rows e * sum n_d + off_d. Each member
  // is its own double-DQN learner: its next action and its target come from its own rows (the
  // per-member terms L_bed below); E = 1 is the plain network. actions [B, D] int64 (shared by
  // the members); rewards, dones [B] F32 (dones 1 = terminal); gamma is the discount of the stored
  // return (gamma^n for n-step returns); weights [B]: importance weights (prioritized replay), 1
  // when None; masks [B, E] F32: bootstrap masks m_be (which members learn from which sample), 1
  // when None.
  //   'c51': projection of r + gamma (1 - done) z onto the support [v_min, v_max], cross-entropy
  //          on the taken action, mean over branches; td_error = that per-sample cross-entropy.
  //   'qr' (QR-DQN, atoms = N >= 1 quantiles at fractions tau_i = (2i + 1) / 2N): the next
  //          action by the mean of the online quantiles, target quantiles T_j = r + gamma (1 - done)
  //          theta_target(s', a*)_j, the quantile Huber loss (kappa 1) sum_i mean_j
  //          |tau_i - 1{T_j < theta_i}| huber(T_j - theta_i) on the taken action, mean over branches;
  //          td_error = that per-sample loss. v_min / v_max are not used.
  //   'iqn' (IQN, docs/iqn-design.md): QR's loss with tau_i = fractions[b, i] ([B, N] F32, each
  //          sample's own, shared by the members; required for 'iqn', refused otherwise), q [B, E * A, N],
  //          q_next_online [B, E * A, K] (the next action by its mean), q_next_target [B, E * A, N'],
  //          the inner mean over N'. A fraction outside [0, 1] (or NaN): the CPU kernel raises, the
  //          CUDA kernel poisons the sample.
  //   'mse' / 'huber' (atoms == 1): BDQ target y = r + gamma (1 - done) mean_d Q_target_d(s', a*_d),
  //          loss mean_d (y - Q_d(s, a_d))^2 or Huber(delta 1); td_error = mean_d |y - Q_d|.
  // With L_bed the term of sample b, member e, branch d (C51: the cross-entropy; QR: the quantile
  // loss; MSE / Huber: on the member's target y_be = r + gamma (1 - done) mean_d Q_target_{e,d}(s', a*_{e,d})):
  //   loss = (1/B) sum_b w_b (1/(E D)) sum_e m_be sum_d L_bed; grad_q = d(loss)/d(q), computed in
  //   the same pass; td_error[b] = (1/(E D)) sum_{e,d} L_bed (|y_be - Q_{e,d}| for MSE / Huber),
  //   unmasked (the transition's priority); mean_q = mean over samples, members and branches of
  //   the expected Q of the taken action, unmasked. E = 1 with masks None is the loss without
  //   members, bit for bit. A NaN/Inf reward or done (which clamping onto the support would hide;
  //   'qr' / 'iqn': any non-finite target quantile) makes that sample's loss and gradient NaN, so that an
  //   optimizer skips the step (a mask of 0 does not clear it); so does an out-of-range action on
  //   CUDA (no host sync can report it), while the CPU kernel raises.
  m.def(
      "dqn_loss(Tensor q, Tensor q_next_online, Tensor q_next_target, Tensor actions, Tensor rewards, "
      "Tensor dones, Tensor? weights, int[] branches, float v_min, float v_max, float gamma, "
      "str loss_type=\"c51\", Tensor? masks=None, Tensor? fractions=None) -> (Tensor loss, Tensor grad_q, "
      "Tensor td_error, Tensor mean_q)");

  // The trainer's step (dqn_ops/step.py): the three ops above with the dueling aggregation
  // and its backward moved into the loss, so that on CUDA the logits make one trip through
  // memory instead of three. Internal (the schemas may change). CPU and CUDA, every network
  // configuration and loss type; each result equals, bit for bit, what the public ops compute
  // on the same backend (bf16_dueling_forward -> dqn_loss -> mixed_backward).
  //   _online_and_target_logits: bf16_dueling_forward stopped before the output bias and the
  //     aggregation, of the online network on state_pairs [2B, SD] = [s; s'] and of the target
  //     network on s': the output layer's GEMM results, no bias, in the padded layout
  //     ([2B, head_ld] and [B, head_ld], params' dtype; csrc/layout.h: head j's columns start
  //     at its pad_col, its padding columns are its zero weight rows' products), and the
  //     online network's activations on all 2B rows (as bf16_dueling_forward returns them).
  //     batch_networks: on CUDA, both networks' hidden layers in one batched GEMM each (the
  //     target also runs on s, rows it drops): fewer launches, more FLOPs. The results are the
  //     same either way, and on the CPU the flag changes nothing.
  //   _dqn_loss_on_logits: the output bias and the dueling aggregation of the three passes
  //     (biases read from each network's params at b_out), dqn_loss with loss_type and masks
  //     ([B, E], E = the layout's ensemble members, as for dqn_loss), and
  //     d(loss)/d(head logits) as mixed_backward's dueling step forms it from grad_q: F32
  //     compact [B, head_out] and BF16 padded [B, head_ld] (padding 0). F32 logits and params
  //     only, as dqn_loss takes F32 only. On CUDA, C51 with atoms <= FUSED_LOSS_MAX_ATOMS or QR,
  //     with branches <= FUSED_LOSS_MAX_BRANCHES, one member and no masks, runs as one fused
  //     kernel; anything else runs the public ops' kernels in sequence. The same bits either way. counter (int32 [1], 0, on
  //     the logits' device): the CUDA loss kernel's block counter, owned by the caller, which
  //     the kernel's last block sets back to 0, so that the launch needs no memset of its own
  //     (a node fewer in a captured step; the trainer's step passes one of its own). It must be
  //     0 at the call: a counter left at another value makes every later call wrong. Calls
  //     that may run at the same time (other streams, two replays of graphs that captured it)
  //     must not share one. The CPU kernel only checks it.
  //   _mixed_backward_from_head: mixed_backward from that head gradient (no dueling step). On
  //     CUDA the `bf16` GEMMs read grad_head_bf16; the CPU kernel reads grad_head and rounds it
  //     itself, as mixed_backward's does. grad_head has params' dtype, grad_head_bf16 is BF16
  //     (as _dqn_loss_on_logits makes it) or, on the CPU, the mirror's dtype (an unrounded path:
  //     a mirror in params' dtype, float64 or F32).
  m.def(
      "_online_and_target_logits(Tensor state_pairs, Tensor params, Tensor params_bf16, Tensor target_params, "
      "Tensor target_params_bf16, int[] layout, bool batch_networks) -> (Tensor logits, "
      "Tensor logits_next_target, Tensor[] activations)");
  m.def(
      "_dqn_loss_on_logits(Tensor logits, Tensor logits_next_online, Tensor logits_next_target, Tensor params, "
      "Tensor target_params, Tensor actions, Tensor rewards, Tensor dones, Tensor? weights, int[] layout, "
      "float v_min, float v_max, float gamma, str loss_type=\"c51\", Tensor? masks=None, Tensor(a!)? counter=None) "
      "-> (Tensor loss, Tensor grad_head, Tensor grad_head_bf16, Tensor td_error, Tensor mean_q)");
  m.def(
      "_mixed_backward_from_head(Tensor grad_head, Tensor grad_head_bf16, Tensor[] activations, Tensor params, "
      "Tensor params_bf16, int[] layout, str precision=\"bf16\") -> Tensor");

  // Acting
  // act: the online network (bf16_dueling_forward's arguments and GEMMs) on states [N, SD],
  // N >= 0, the expected Q of every action as loss_type reads the outputs ('c51': sum_i
  // softmax(q)_i z_i over the support [v_min, v_max], q itself for one atom; 'qr': the mean of
  // the quantiles; 'mse' / 'huber': q, one atom), per branch the greedy action (the first of equal maxima, a
  // NaN wins) and epsilon-greedy on csrc/philox.h's stream layout (stream kAct): row n explores
  // iff uniform(draw(seed, call, n, 0)) < epsilon, then branch d takes below(draw(seed, call, n,
  // 1 + d), n_d). epsilon: a one-element F32 device tensor (NaN never explores); rng: int64 [2]
  // = (seed, call), read on the device and advanced by one call per op with N > 0 (N = 0 leaves
  // it), so a graph replay draws new numbers. actions [N, D] int64; greedy_q [N, D] the greedy
  // action's expected Q before exploration (params' dtype: F32, F64 on the CPU's float64 path).
  // An ensemble of E members (the layout's) scores action k of a branch by
  //   score_k = mean_e Q_e(k) + ucb * std_e Q_e(k)   (population std over the members; the CPU
  //   computes it in double, the CUDA kernel in F32, where |ucb| must fit),
  // the greedy action the first argmax of the score (a NaN wins), greedy_q its mean_e Q_e. ucb:
  // any finite value (> 0 optimism, UCB exploration; < 0 pessimism, a lower confidence bound);
  // NaN or Inf raises (Inf * a std of 0 would be NaN). With one member the std is 0 and ucb
  // changes nothing; ucb = 0 takes the argmax of the mean. An IQN network acts with loss_type
  // 'iqn' at fractions [K] shared by every row (the trainer's: the midpoints (2k + 1) / 2K): an
  // action's expected Q is the mean of its K values (docs/iqn-design.md, "Acting").
  m.def(
      "act(Tensor states, Tensor params, Tensor params_bf16, int[] layout, float v_min, float v_max, "
      "Tensor epsilon, Tensor(a!) rng, str loss_type=\"c51\", float ucb=0.0, Tensor? fractions=None) -> "
      "(Tensor actions, Tensor greedy_q)");

  // act's exploration alone, for greedy actions chosen elsewhere (e.g. by a plain PyTorch
  // network, so that a baseline explores with dqn_ops's draws): greedy [N, D] int64 (passed
  // through unread where a row does not explore), branches: the D branch sizes n_d >= 1,
  // epsilon and rng as act takes them, all on greedy's device. actions[n] = greedy[n] unless
  // row n explores (the same draws as act with the same rng: uniform(draw(seed, call, n, 0)) <
  // epsilon), then branch d takes below(draw(seed, call, n, 1 + d), n_d); rng advanced by one
  // call when N > 0.
  m.def("epsilon_greedy(Tensor greedy, int[] branches, Tensor epsilon, Tensor(a!) rng) -> Tensor");

  // Bootstrap masks of an ensemble (bootstrapped DQN, Osband et al. 2016; dqn_loss's masks):
  // indices [B] int64, the replay rows of a batch (any values: their 64 bits are the counter) ->
  // masks [B, members] F32 on indices' device, masks[b, e] = 1.0 iff
  //   uniform(draw(seed, call = indices[b], row = e, slot 0)) < p   (csrc/philox.h, stream kBootstrap;
  // the comparison in double), else 0.0: member e learns from a transition with probability p. A
  // pure function of (seed, index, member): a transition keeps its masks for its life in the
  // replay with nothing stored, and the op holds no state (capturable). members >= 1 (up to
  // 2^32, philox's row), 0 < p <= 1 (p = 1: all ones).
  m.def("bootstrap_masks(Tensor indices, int seed, int members, float p) -> Tensor");

  // IQN's quantile fractions (Dabney et al. 2018; docs/iqn-design.md, "Fractions in the trainer"):
  // rng int64 [2] = (seed, call) -> tau [batch, n] and tau_target [batch, n_target] F32 on rng's
  // device, drawn on csrc/philox.h's stream kIqnFractions (csrc/iqn_fractions_args.h):
  //   tau[b, i]        = uniform(draw(seed, call, row = row_offset + b, slot = i))
  //   tau_target[b, j] = uniform(draw(seed, call, row = row_offset + b, slot = 2^17 + j))
  // uniform: the top 24 bits / 2^24, in [0, 1 - 2^-24]; tau_target does not depend on n, nor tau
  // on n_target. row_offset: the batch's first global row (rank * B under data parallelism, so
  // that ranks draw different fractions). rng's call is read and advanced by one on the device
  // (no host read: capturable, each graph replay draws the next call's). batch >= 1;
  // 1 <= n, n_target < 2^17; row_offset >= 0 and row_offset + batch <= 2^32 (philox's row).
  m.def(
      "iqn_fractions(Tensor(a!) rng, int batch, int n, int n_target, int row_offset) -> (Tensor tau, "
      "Tensor tau_target)");

  // Replay
  // The replay buffer on the device (dqn_ops/rl/replay.py), internal (the schemas may change).
  // Its state is tensors only (csrc/replay_args.h): storage = [states, actions, rewards,
  // next_states, dones] (capacity C rows), cursor = int64 [2] (next row, size), tree = [] for a
  // uniform buffer or [leaves, sums, mins, max_priority] (a fan-out-32 sum tree with F64 inner
  // sums and a min tree), rng = int64 [2] (seed, call), counter: int32 scratch, zero between
  // calls. No host reads: every op is capturable in a CUDA graph. Deterministic bits for a seed;
  // the same indices on both backends, except that priorities and weights go through each
  // backend's pow (CUDA's may differ from glibc's in the last bit, rarely), and a draw that
  // falls exactly there could then pick a neighbouring row. Single-stream: the ops of one
  // buffer must run in order (the tree is rebuilt in place).
  //   _replay_add: N rows at the cursor (wrapping), their priority the running max; 1 launch.
  //   _replay_add_steps: one step of E envs into each env's window of n steps (window = [obs
  //     [E, n, SD], actions [E, n, D], rewards [E, n], pos int64 [E, 2], emit int64 [E + 1]]),
  //     then the n-step transitions that complete, in env order (replay_args.h: nstep_done says
  //     what `done` means for a truncated window); 2 launches.
  //   _replay_sample: B = out[0].size(0) rows into out = [states, actions, rewards, next_states,
  //     dones, weights, indices]: uniform over the filled rows (weights 1), or stratified
  //     proportional draws with weights (p_min / p_i)^beta; advances rng's call; 1 launch.
  //   _replay_update_priorities: p = (|td| + eps)^alpha at indices (duplicates: the largest),
  //     the running max raised; a non-finite td_error leaves its row unchanged and adds 1 to
  //     skipped; an index outside the filled rows raises on the CPU and, on CUDA, is skipped and
  //     counted the same way; 1 launch.
  m.def(
      "_replay_add(Tensor(a!)[] storage, Tensor(b!) cursor, Tensor(c!)[] tree, Tensor(d!) counter, Tensor[] rows) "
      "-> ()");
  m.def(
      "_replay_add_steps(Tensor(a!)[] storage, Tensor(b!) cursor, Tensor(c!)[] tree, Tensor(d!)[] window, "
      "Tensor(e!) counter, Tensor obs, Tensor actions, Tensor rewards, Tensor next_obs, Tensor terminated, "
      "Tensor truncated, float gamma) -> ()");
  m.def(
      "_replay_sample(Tensor[] storage, Tensor cursor, Tensor[] tree, Tensor beta, Tensor(a!) rng, Tensor(b!) counter, "
      "Tensor(c!)[] out) -> ()");
  m.def(
      "_replay_update_priorities(Tensor(a!)[] tree, Tensor cursor, Tensor indices, Tensor td_error, "
      "Tensor(b!) skipped, float alpha, float eps) -> ()");

  // Environments
  // FuturesTradingEnv (dqn_ops/rl/envs.py; the step: csrc/env_math.h). Internal: the env class
  // owns the tensors. N environments; state [3, N] F32 (rows: gap = fair value - log price,
  // regime, position), counters [2, N] int64 (rows: steps = the market's step count, clock =
  // steps into the episode), returns [N, 84] F32 (the ring of the last 84 returns, the next at
  // steps % 84), observations [2, N, 96] F32 (rows: next_obs, obs), info [5, N] F32 (rows:
  // reward, terminated, truncated, pnl, traded).
  //   _futures_env_step: actions [N, 3] int64 (direction, size, speed). Each env trades, its
  //     market moves one step and its episode ends at episode_length (position and clock to 0;
  //     the market runs on): next_obs is the observation the action led to, obs the one to act
  //     on next. Random numbers: csrc/philox.h (stream kEnv) with key = seed, call = the env's steps before
  //     the step, row = the env's index; slot 0: the regime-switch uniform, 1: the new regime,
  //     2 and 3: the Box-Muller uniforms of the two normals (return noise = cos, fair-value
  //     noise = sin). An action outside [0, 3) raises on the CPU; on CUDA it trades nothing and
  //     makes that env's pnl and reward NaN. One kernel launch on CUDA.
  //   _futures_env_reset: every env starts an episode (position and clock 0), the market does
  //     not move; writes obs only.
  m.def(
      "_futures_env_step(Tensor actions, Tensor(a!) state, Tensor(b!) counters, Tensor(c!) returns, "
      "Tensor(d!) observations, Tensor(e!) info, int seed, int episode_length, float kappa, float trend, "
      "float sigma, float sigma_fair, float switch_prob, float cost) -> ()");
  m.def(
      "_futures_env_reset(Tensor(a!) state, Tensor(b!) counters, Tensor returns, Tensor(c!) observations, "
      "float sigma, int episode_length) -> ()");
}

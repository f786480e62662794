// The Python module of the CPU kernels: the one file that includes pybind11 and torch's Tensor
// casters. Not <torch/extension.h>: that is all of torch's C++ API, ~27 s of headers to compile
// (this header ~10 s); the kernel files include ATen's headers alone (~4 s).
#include <torch/csrc/utils/pybind.h>

#include "thread_pool.h"

#include "decoder_layers.h"
#include "host_memory.h"
#include "kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The kernels run without the GIL, as torch's own operators do: a serving node's asyncio
  // thread (receiving requests, sending tokens) can then run on a spare core while the engine
  // thread computes. On a 2-core machine running 2 compute threads there is no spare core, and
  // A/Bs there disagreed (session 34, SmolLM2 fp32 served: +2% by one method, -3 to -4% by two
  // others; README, the AVX2 list).
  const auto no_gil = py::call_guard<py::gil_scoped_release>();
  m.def("paged_decode_attention", &paged_decode_attention,
        "paged attention for single-token queries (CPU); window > 0: the last window positions",
        py::arg("q"), py::arg("cache"), py::arg("tables"), py::arg("seq_lens"), py::arg("scale"),
        py::arg("window") = 0, no_gil);
  m.def("paged_decode_attention_out", &paged_decode_attention_out,
        "paged_decode_attention into out (q and out may be row-strided views)", py::arg("q"),
        py::arg("cache"), py::arg("tables"), py::arg("seq_lens"), py::arg("scale"),
        py::arg("out"), py::arg("window") = 0, no_gil);
  m.def("paged_prefill_attention_out", &paged_prefill_attention_out,
        "causal attention of every prefill's query rows over its paged context, into out's rows",
        py::arg("q"), py::arg("cache"), py::arg("query_start"), py::arg("query_len"),
        py::arg("context_len"), py::arg("block_tables"), py::arg("scale"), py::arg("out"),
        py::arg("window") = 0, no_gil);
  m.def("store_kv", &store_kv, "store new tokens' K/V at their cache slots (CPU)", no_gil);
  m.def("rms_norm", &rms_norm, "RMSNorm of the rows of x (fp32 statistics)", no_gil);
  m.def("fused_add_rms_norm", &fused_add_rms_norm,
        "residual += x, then x = RMSNorm(residual), both in place", no_gil);
  m.def("rotary_embedding", &rotary_embedding, "rotate-half RoPE of q and k, in place", no_gil);
  m.def("silu_and_mul", &silu_and_mul, "silu(x[..., :d]) * x[..., d:]", no_gil);
  m.def("gemma_rms_norm", &gemma_rms_norm,
        "Gemma's RMSNorm of x's rows (x * (1 + weight), float32, rounded once); rows may be "
        "strided heads",
        no_gil);
  m.def("gemma_add_rms_norm", &gemma_add_rms_norm,
        "residual += x, then x = gemma_rms_norm(residual), both in place", no_gil);
  m.def("gelu_tanh_and_mul", &gelu_tanh_and_mul, "gelu_tanh(x[..., :d]) * x[..., d:]", no_gil);
  m.def("argmax_rows", &argmax_rows,
        "row-wise argmax of a float32 matrix (torch.argmax's answer)", no_gil);
  m.def("fused_ops_vectorized", &fused_ops_vectorized, "whether the AVX-512 paths are built");
  m.def("pack_linear_weight", &pack_linear_weight, "W [N, K] (bf16 or float32) in linear_small_m's layout");
  m.def("linear_small_m", &linear_small_m, "x W^T (+ b), few rows: bf16 on AMX, else AVX2 / AVX-512 loops", py::arg("x"),
        py::arg("packed"), py::arg("n"), py::arg("bias") = py::none(), no_gil);
  m.def("linear_small_m_all_rows", &linear_small_m_all_rows,
        "whether linear_small_m should take every row count (AVX2 CPUs: it outruns oneDNN)");
  m.def("set_threads_hot", &pdserve_cpu::set_threads_hot,
        "while hot (inside an engine step), the kernels' idle pool workers spin between loops "
        "instead of sleeping (thread_pool.h)",
        py::arg("hot"));
  m.def("kernel_pool_enabled", &pdserve_cpu::pool_enabled,
        "whether the kernels' loops run on their own worker pool (else OpenMP)");
  m.def("kernel_pool_jobs", &pdserve_cpu::pool_jobs, "loops the kernels' pool has run in this process");
  m.def("populate_when_idle", &pdserve_cpu::populate_when_idle,
        "once a core has been free for free_s, fault [address, address + length) in, contents "
        "unchanged: 0, EAGAIN (no free core within timeout_s) or an errno (host_memory.h)",
        py::arg("address"), py::arg("length"), py::arg("timeout_s"), py::arg("free_s"), no_gil);
  m.def("populate_cancel", &pdserve_cpu::populate_cancel,
        "populate_when_idle returns ECANCELED from now on, waiting calls at once");
  py::class_<pdserve_cpu::LlamaLayers>(
      m, "LlamaLayers",
      "a Llama-family decoder's layers over these kernels, one call per forward "
      "(decoder_layers.cpp)")
      .def(py::init<std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>,
                    std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>,
                    std::vector<c10::optional<at::Tensor>>, std::vector<c10::optional<at::Tensor>>,
                    std::vector<c10::optional<at::Tensor>>, std::vector<c10::optional<at::Tensor>>,
                    std::vector<c10::optional<at::Tensor>>, std::vector<c10::optional<at::Tensor>>,
                    std::vector<int64_t>, int64_t, int64_t, int64_t, int64_t, int64_t, double,
                    double>(),
           py::arg("input_norms"), py::arg("post_norms"), py::arg("qkv"), py::arg("o"),
           py::arg("gate_up"), py::arg("down"), py::arg("qkv_bias"), py::arg("o_bias"),
           py::arg("gate_up_bias"), py::arg("down_bias"), py::arg("q_norms"),
           py::arg("k_norms"), py::arg("windows"),
           py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("head_dim"),
           py::arg("hidden_size"), py::arg("intermediate_size"), py::arg("eps"),
           py::arg("scale"))
      .def("forward", &pdserve_cpu::LlamaLayers::forward,
           "every layer over one step's rows: (last mlp output, residual)", py::arg("x"),
           py::arg("residual"), py::arg("cos"), py::arg("sin"), py::arg("kv_caches"),
           py::arg("slot_mapping"), py::arg("num_decode"), py::arg("decode_tables"),
           py::arg("decode_lens"), py::arg("query_start"), py::arg("query_len"),
           py::arg("context_len"), py::arg("block_tables"), no_gil)
      .def_property_readonly("num_layers", &pdserve_cpu::LlamaLayers::num_layers);
  py::class_<pdserve_cpu::GemmaLayers>(
      m, "GemmaLayers",
      "Gemma 3's decoder layers over these kernels, one call per forward (decoder_layers.cpp)")
      .def(py::init<std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>,
                    std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>,
                    std::vector<at::Tensor>, std::vector<at::Tensor>,
                    std::vector<c10::optional<at::Tensor>>, std::vector<c10::optional<at::Tensor>>,
                    std::vector<c10::optional<at::Tensor>>, std::vector<c10::optional<at::Tensor>>,
                    std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<int64_t>,
                    std::vector<bool>, int64_t, int64_t, int64_t, int64_t, int64_t, double,
                    double>(),
           py::arg("input_norms"), py::arg("post_attention_norms"),
           py::arg("pre_feedforward_norms"), py::arg("post_feedforward_norms"), py::arg("qkv"),
           py::arg("o"), py::arg("gate_up"), py::arg("down"), py::arg("qkv_bias"),
           py::arg("o_bias"), py::arg("gate_up_bias"), py::arg("down_bias"), py::arg("q_norms"),
           py::arg("k_norms"), py::arg("windows"), py::arg("local_rope"), py::arg("num_heads"),
           py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("hidden_size"),
           py::arg("intermediate_size"), py::arg("eps"), py::arg("scale"))
      .def("forward", &pdserve_cpu::GemmaLayers::forward,
           "every layer over one step's rows: (last normed mlp output, residual)", py::arg("x"),
           py::arg("residual"), py::arg("cos"), py::arg("sin"), py::arg("local_cos"),
           py::arg("local_sin"), py::arg("kv_caches"), py::arg("slot_mapping"),
           py::arg("num_decode"), py::arg("decode_tables"), py::arg("decode_lens"),
           py::arg("query_start"), py::arg("query_len"), py::arg("context_len"),
           py::arg("block_tables"), no_gil)
      .def_property_readonly("num_layers", &pdserve_cpu::GemmaLayers::num_layers);
  m.def("linear_small_m_available", &linear_small_m_available,
        "whether linear_small_m runs here (an AVX2 + FMA build; bf16 on AMX builds needs the OS's grant)");
}

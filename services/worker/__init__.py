"""The worker: the model runner of one worker group (StepPlan in, StepResult out).

Reading order:
- `service` (the bus edge: steps in, results out) around `runner/`: `model_runner` (one step,
  no I/O), `input_batch` (the persistent batch), `in_flight` (tokens fed forward between
  overlapped steps), `kv_cache` (the paged KV tensors), `routed_experts`, `bootstrap`
  (settings -> a ready runner), `step_thread`, `step_timeline` (and its offline reader
  `step_timeline_report`; `kernel_trace` reads a profiled run's kernels);
- `models/`: the model families, built from `layer_impls` (which implementation each Linear,
  RMSNorm and gated MLP runs: the reference, or the Triton layers of accel/cuda_layers), chosen
  by `loader/` per device (safetensors and GGUF -> our parameters);
- `attention/`: `select` is the one entry point that says which attention runs on each device
  (`reference` on CPU, the C++ decode kernel, the Triton kernels in meshllm_kernels/attention on
  CUDA, `dense_prefill`), with `groups` (metadata per KV cache group) and `bound` (an opaque op for
  compiled CPU forwards);
- `accel/`: what runs faster where it can: `cuda_layers` (the Triton layers, `TRITON`) and
  `decode_chain` (the fused decode forward a Llama model holds on CUDA), `cuda_graphs` (decode
  steps) and `verify_graphs` (steps that verify drafts),
  `cpu_compile` (inductor on CPU);
- `sampling/` (per-row state and the Gumbel-max draw; its maths in meshllm_kernels/sampling),
  `spec/` (drafters and verification), `kv_offload/` (KV blocks <-> the Redis tier);
- `parallel/`: tensor parallelism (MESHLLM_TP): the rank processes of one group, the shard of
  the model each holds, the collectives its layers run.
"""

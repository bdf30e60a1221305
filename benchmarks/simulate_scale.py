"""lp-simulate at the scale users run: how long a whole world takes to simulate on this machine.

    python -m benchmarks.simulate_scale                      # every case below
    python -m benchmarks.simulate_scale --cases llama3-70b/4096

Each case builds a published model shape from a Hugging Face config on ``meta`` (the recipe
``examples.nlp.hf_causal_lm.HFCausalLM``: nothing downloads, nothing the model's size is allocated) and simulates
one layout with :func:`lightning_parallel.planner.simulate`: the suite's real composition once per rank class in
torch's fake process group, the bytes each class stores, and the whole-world check over every rank. The time is the
wall time of ``simulate`` in this one process (targets: 120 s for 4,096 and 1,024 ranks, 300 s for 16,384). The fit is
against an 80 GB H100 (``conf/cluster/h100_cluster.yaml``).
"""

from __future__ import annotations

import argparse
import json
import time
from functools import partial
from pathlib import Path
from typing import Any

LLAMA3_70B = {"hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64,
              "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 131072, "rope_theta": 500000.0,
              "tie_word_embeddings": False}
MIXTRAL_8X7B = {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
                "num_key_value_heads": 8, "head_dim": 128, "num_local_experts": 8, "num_experts_per_tok": 2,
                "max_position_embeddings": 32768, "tie_word_embeddings": False}
QWEN3_30B_A3B = {"hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48,
                 "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
                 "num_experts_per_tok": 8, "max_position_embeddings": 32768, "tie_word_embeddings": False}

# name -> (model type, config, vocabulary, world size, ParallelOptions keywords)
CASES: dict[str, tuple[str, dict[str, Any], int, int, dict[str, Any]]] = {
    "llama3-70b/4096": ("llama", LLAMA3_70B, 128256, 4096,
                        {"pipeline_parallel_size": 8, "tensor_parallel_size": 8, "context_parallel_size": 2,
                         "data_parallel_size": 32, "data_replicate_size": 2, "zero_stage": 3, "microbatches": 8}),
    "mixtral-8x7b/1024": ("mixtral", MIXTRAL_8X7B, 32000, 1024,
                          {"pipeline_parallel_size": 1, "tensor_parallel_size": 1, "data_parallel_size": 1024,
                           "expert_parallel_size": 8, "zero_stage": 3}),
    "qwen3-30b-a3b/1024": ("qwen3_moe", QWEN3_30B_A3B, 151936, 1024,
                           {"pipeline_parallel_size": 1, "tensor_parallel_size": 1, "data_parallel_size": 1024,
                            "expert_parallel_size": 64, "zero_stage": 3}),
    "llama3-70b/16384": ("llama", LLAMA3_70B, 128256, 16384,
                         {"pipeline_parallel_size": 8, "tensor_parallel_size": 8, "context_parallel_size": 2,
                          "data_parallel_size": 128, "data_replicate_size": 2, "zero_stage": 3, "microbatches": 8}),
}
LLAMA3_8B = {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
             "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 131072, "rope_theta": 500000.0,
             "tie_word_embeddings": False}
LLAMA3_405B = {"hidden_size": 16384, "intermediate_size": 53248, "num_hidden_layers": 126, "num_attention_heads": 128,
               "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 131072, "rope_theta": 500000.0,
               "tie_word_embeddings": False}
DEEPSEEK_V3 = {"hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
               "num_attention_heads": 128, "num_key_value_heads": 128, "n_routed_experts": 256, "n_shared_experts": 1,
               "num_experts_per_tok": 8, "first_k_dense_replace": 3, "q_lora_rank": 1536, "kv_lora_rank": 512,
               "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "head_dim": 64,
               "tie_word_embeddings": False}
# Published layouts beside the memory their authors report (docs/simulation.md's table): name -> (model type,
# config, vocabulary, world, ParallelOptions keywords, (batch per rank, sequence), published GiB, source).
TORCHTITAN = "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md"
PUBLISHED: dict[str, tuple] = {
    "llama3-8b/8 fsdp": ("llama", LLAMA3_8B, 128256, 8,
                         {"data_parallel_size": 8, "zero_stage": 3, "activation_checkpointing": "selective"},
                         (2, 8192), 82.4, f"{TORCHTITAN}, table 1 (FSDP, no compile)"),
    "llama3-8b/8 fsdp2 x cp4 128k": ("llama", LLAMA3_8B, 128256, 8,
                                     {"data_parallel_size": 2, "context_parallel_size": 4, "zero_stage": 3,
                                      "activation_checkpointing": "full"},
                                     (1, 131072), 84.0, f"{TORCHTITAN}, table 2 (with compile and Float8)"),
    "llama3-70b/256 fsdp32 x tp8": ("llama", LLAMA3_70B, 128256, 256,
                                    {"data_parallel_size": 32, "tensor_parallel_size": 8, "zero_stage": 3,
                                     "activation_checkpointing": "full", "sequence_parallel": True,
                                     "loss_parallel": True},
                                    (16, 8192), 71.9, f"{TORCHTITAN}, table 4 (2D, compile and Float8)"),
    "llama3-405b/512 fsdp8 x tp8 x pp8": ("llama", LLAMA3_405B, 128256, 512,
                                          {"data_parallel_size": 8, "tensor_parallel_size": 8,
                                           "pipeline_parallel_size": 8, "zero_stage": 3, "microbatches": 32,
                                           "activation_checkpointing": "full", "loss_parallel": True,
                                           "sequence_parallel": True},
                                          (32, 8192), 82.5, f"{TORCHTITAN}, table 5 (1F1B, compile, Float8)"),
}
PUBLISHED["deepseek-v3/256 ep64 fsdp"] = ("deepseek_v3", DEEPSEEK_V3, 129280, 256,
                                          {"data_parallel_size": 256, "expert_parallel_size": 64, "zero_stage": 3,
                                           "expert_data_shard": True,
                                           "activation_checkpointing": "selective"},
                                          (4, 4096), None, "pytorch/torchtitan deepseek_v3_671b.toml (local batch 4, "
                                          "sequence 4096, selective checkpointing): no memory reading published")
GIB = 2**30


def run_case(name: str) -> dict[str, Any]:
    """Simulate one case; its figures (times, classes, bytes per rank, the fit on an 80 GB device)."""
    from examples.nlp.hf_causal_lm import HFCausalLM
    from lightning_parallel.parallel.options import ParallelOptions
    from lightning_parallel.planner import simulate

    model_type, config, vocab, world, options = CASES[name]
    factory = partial(HFCausalLM, config=model_type, config_overrides=config, vocab_size=vocab)
    started = time.perf_counter()
    simulation = simulate(factory, ParallelOptions(**options), world, num_nodes=world // 8, precision="bf16-mixed",
                          device_memory=80e9)
    seconds = time.perf_counter() - started
    peaks = [c.peak_bytes for c in simulation.classes]
    return {"case": name, "world": world, "layout": simulation.layout, "classes": len(simulation.classes),
            "simulated_ranks_seconds": round(sum(c.seconds for c in simulation.classes), 1),
            "seconds": round(seconds, 1), "elements_checked": simulation.elements_checked,
            "stored_gib": [round((c.parameter_bytes + c.gradient_bytes + c.optimizer_bytes) / GIB, 2)
                           for c in simulation.classes],
            "peak_gib_min_max": (round(min(peaks) / GIB, 2), round(max(peaks) / GIB, 2)), "fits_80gb": simulation.fits}


def run_published(name: str) -> dict[str, Any]:
    """Simulate one published layout with one step of its batch on ``meta``; the most loaded class's figures."""
    from examples.nlp.hf_causal_lm import HFCausalLM
    from lightning_parallel.parallel.options import ParallelOptions
    from lightning_parallel.planner import simulate
    from lightning_parallel.planner.simulation.step import token_batch

    model_type, config, vocab, world, options, shape, published, source = PUBLISHED[name]
    # No step where the shape is None (bytes only); MoE layers step with balanced routing (simulation/routing.py).
    batch = None if shape is None else partial(token_batch, shape[0], shape[1], True)
    overrides = config if shape is None else {**config, "max_position_embeddings": shape[1]}
    factory = partial(HFCausalLM, config=model_type, config_overrides=overrides, vocab_size=vocab)
    started = time.perf_counter()
    simulation = simulate(factory, ParallelOptions(**{"pipeline_parallel_size": 1, "tensor_parallel_size": 1,
                                                       **options}), world, num_nodes=max(world // 8, 1),
                          precision="bf16-mixed", device_memory=96 * GIB, batch=batch)
    top = max(simulation.classes, key=lambda c: c.peak_bytes)
    return {"case": name, "layout": simulation.layout, "seconds": round(time.perf_counter() - started, 1),
            "stored_gib": round((top.parameter_bytes + top.gradient_bytes + top.optimizer_bytes) / GIB, 2),
            "gathered_gib": round(top.gathered_bytes / GIB, 2),
            "activation_gib": None if top.activation_bytes is None else round(top.activation_bytes / GIB, 2),
            "peak_gib": round(top.peak_bytes / GIB, 2), "published_gib": published, "source": source,
            "notes": list(top.notes)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    parser.add_argument("--out", default=None, help="a JSON file for the results")
    parser.add_argument("--published", nargs="*", default=None, choices=list(PUBLISHED),
                        help="simulate published layouts (with a step) instead, beside their reported memory")
    args = parser.parse_args()
    if args.published is not None:
        for name in args.published or list(PUBLISHED):
            print(json.dumps(run_published(name)), flush=True)
        return
    results = []
    for name in args.cases:
        result = run_case(name)
        results.append(result)
        print(f"{name:22} {result['world']:>6,} ranks  {result['layout']:32} {result['classes']:>3} classes  "
              f"{result['seconds']:>6.1f} s  peak {result['peak_gib_min_max'][0]}-{result['peak_gib_min_max'][1]} "
              f"GiB  fits 80 GB: {result['fits_80gb']}", flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

"""The GPT model, its FLOPs count and GPU peak throughput (for MFU)."""

from tokenmill.model.flops import PEAK_FLOPS, flop_params, flops_per_token, math_mode, peak_flops
from tokenmill.model.gpt import GPT, Block, adapt_state_dict
from tokenmill.model.moe import balance_experts, router_stats

__all__ = ["GPT", "Block", "adapt_state_dict", "flop_params", "flops_per_token", "peak_flops", "math_mode", "PEAK_FLOPS",
           "balance_experts", "router_stats"]

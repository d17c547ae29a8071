#!/usr/bin/env bash
# The whole MoE parity comparison against torchtitan 0.2.2's own FSDP2 + EP (tests/test_titan_moe.py):
# qwen3 debugmodel_moe (with fp32 experts: amsp_dtensor.testing.fp32_experts) and deepseek_v3
# debugmodel, ep 2 on 4 CPU ranks, every plan pair of the test, 10 steps, every step's loss
# within 1e-5 relative, and deepseek_v3 on 8 ranks (pp 2, ep 2). About 45 minutes here.
# CI runs deepseek_v3 on 4 ranks (every pair) for 3 steps.
set -euo pipefail
cd "$(dirname "$0")/.."
AMSP_TITAN_MOE_STEPS=${AMSP_TITAN_MOE_STEPS:-10} AMSP_TITAN_MOE_PAIRS=all AMSP_TITAN_MOE_8=1 \
AMSP_TITAN_MOE_MODELS=${AMSP_TITAN_MOE_MODELS:-qwen3,deepseek_v3} \
    python -m pytest -q tests/test_titan_moe.py -k "loss_matches or 8_ranks" "$@"

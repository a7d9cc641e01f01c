"""One line per report.json under the folder given (scripts/kv-proof.sh): the figures docs/kv-formats.md quotes."""
import json
import os
import sys

W = sys.argv[1]
for name in sorted(os.listdir(W)):
    p = os.path.join(W, name, "report.json")
    if not os.path.isfile(p):
        continue
    try:
        r = json.load(open(p))
    except Exception as e:  # a half-written report is worth a line, not a crash
        print(f"{name:22} unreadable: {e}")
        continue
    res, t, e = r["results"], r["timing"], r["execution"]
    o = res["overall"]
    kl = res.get("kl_divergence") or {}
    inv = res.get("invariance")
    pc = e.get("prefill_chunk_tokens", {})
    line = (f"{name:22} kv={e.get('kv_format')} ref={e.get('reference')} lossless={e.get('lossless')} yarn={e.get('rope_yarn_factor')} "
            f"pc={pc.get('requested')}/{pc.get('effective')} win={o['n_windows']} scored={o['scored_tokens']} "
            f"PPL={o['perplexity']:.4f} nonfinite={o['n_nonfinite']} tok/s={t['tokens_per_second_processed']:.0f} "
            f"proc={t['tokens_processed']} score_s={t['scoring_seconds']:.1f} load_s={t['load_seconds']:.1f}")
    if kl:
        line += (f" KL={kl['mean']:.6f}+-{kl.get('mean_se_clustered', float('nan')):.6f} p99={kl['quantiles']['p99']:.4f} "
                 f"top1={100 * kl['top1_agreement']:.2f}% dNLL={kl.get('mean_nll_delta', float('nan')):+.5f}"
                 f"+-{kl.get('mean_nll_delta_se_clustered', float('nan')):.5f}")
    if inv:
        line += (f" INV n={inv['n_windows']} targets={inv['n_targets']} max|dNLL|={inv['max_abs_dnll']:.3e} "
                 f"mean|dNLL|={inv['mean_abs_dnll']:.3e} meanKL={inv['mean_kl']:.3e} maxKL={inv['max_kl']:.3e} "
                 f"top1changed={inv['n_top1_changed']} batched={inv['batched_windows_per_pass']}x{inv['batched_prefill_chunk']} alone={inv['alone']}")
    print(line)

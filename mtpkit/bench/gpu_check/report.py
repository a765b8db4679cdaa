"""The printed report: one line per check or run under each section, then one summary line per section."""

from __future__ import annotations


def _mark(rec: dict) -> str:
    if "skipped" in rec:
        return "skip"
    if "error" in rec:
        return "ERROR"
    return {True: "ok", False: "FAIL", None: ""}[rec.get("ok")]


def correctness_lines(section: dict) -> list[str]:
    lines = []
    for c in section.get("checks", []):
        what = c["name"] + (f" [{c['dtype']}]" if "dtype" in c else "")
        if "skipped" in c:
            detail = c["skipped"]
        elif "error" in c:
            detail = c["error"]
        elif "errors" in c:  # kernel checks
            worst = max(c["errors"], key=c["errors"].get)
            tol = c["tolerance"]["grad" if worst.startswith("grad_") else "value"]
            detail = f"{c['impl']}: worst {worst} {c['errors'][worst]:.2g} (tol {tol:g})"
        elif "rel_max_err" in c:
            detail = f"rel max err {c['rel_max_err']:.2g} (tol {c['tolerance']:g})"
            if "argmax_agreement" in c:
                detail += f", argmax agreement {c['argmax_agreement']:.3f}"
        else:
            detail = ", ".join(f"{k} {v}" for k, v in c.items() if k.startswith(("k", "hf_")))
        lines.append(f"  {_mark(c):>5}  {what:<52} {detail}" + (f"  ({c['note']})" if "note" in c else ""))
    return lines


def decoding_lines(section: dict) -> list[str]:
    lines = ["  model  batch  engine      plain tok/s  k=1 / k=2 / k=3 tok/s  spec step/plain k=1..3  "
             "verify2,3,4/decode  decode ms  GB/s (of copy)  oracle k=1..3  HF tok/s"]
    for r in section.get("runs", []):
        if "plain_tokens_per_s" not in r:
            info = r.get("skipped") or r.get("error") or f"logits vs mtpkit: rel max err {r.get('rel_max_err_logits')}"
            lines.append(f"  {_mark(r):>5}  {r['name']} {r.get('batch', '')}: {info}")
            continue
        ks = [r[f"k{k}"] for k in (1, 2, 3)]
        bw = f"{r['achieved_GBps']}" + (f" ({100 * r['fraction_of_measured_bandwidth']:.0f}%)"
                                        if "fraction_of_measured_bandwidth" in r else "")
        oracle = " / ".join(f"{r[f'oracle_k{k}_r1']['speedup']}x" for k in (1, 2, 3))
        lines.append(
            f"  {r['name'].removeprefix('decode '):<6} {r['batch']:>5}  {r.get('engine', 'eager'):<10}  "
            f"{r['plain_tokens_per_s']:>11}  {' / '.join(str(k['tokens_per_s']) for k in ks):>22}  "
            f"{' / '.join(str(k['break_even_acceptance_length']) for k in ks):>22}  "
            f"{' / '.join(str(r[f'verify{k + 1}_over_decode']) for k in (1, 2, 3)):>18}  {r['decode_ms']:>9}  "
            f"{bw:>14}  {oracle:>13}  {r.get('hf_tokens_per_s', '-')}")
    return lines


def training_lines(section: dict) -> list[str]:
    lines = ["  shape  world  compile  AC   MTP   tok/s     MFU    peak GB  step s  first step s"]
    for r in section.get("runs", []):
        head = (f"  {r['shape']:<6} {r['world']:>5}  {'on' if r['compile'] else 'off':<7}  "
                f"{'on' if r['ac'] else 'off':<3}  {'on' if r['mtp'] else 'off':<4}")
        if "tokens_per_s" not in r:
            lines.append(f"{head}  {_mark(r)}: {r.get('skipped') or r.get('error')}")
            continue
        mfu = f"{100 * r['mfu']:.1f}%" if "mfu" in r else "-"
        mem = r.get("peak_memory_gb", "-")
        lines.append(f"{head}  {r['tokens_per_s']:>8.0f}  {mfu:>6}  {mem:>7}  {r['step_s']:>6}  {r['first_step_s']:>12}")
    for r in section.get("mtp_ratios", []):
        lines.append(f"  MTP on/off {r['shape']} compile {r['compile']} AC {r['ac']} x{r['world']}: time x{r['time_ratio']}"
                     f" (FLOPs model x{r['flops_ratio']})"
                     + (f", peak memory x{r['memory_ratio']}" if "memory_ratio" in r else ""))
    lines += [f"  error: {e[:300]}" for e in section.get("errors", [])]
    return lines

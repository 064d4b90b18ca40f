"""What the goodput controller's gating of prompt lookup leaves on the table, one row at a time.

    python benchmarks/lookup_gating.py --target ../shared/models/stories260K --rounds 3

Runs prompt lookup's fixed trie and prompt lookup under `Adaptive` on the same
prompts, back to back per prompt, one row each, greedy. For each it reports its
tokens per second and the steps that verified a tree and those that did not:
how many, their time, the draft nodes verified and the tokens accepted. On
every step where the adaptive row verified no tree, the row's lookup state is
asked on the side what it would have proposed (its n-gram index is all it
reads); once the generation is done, that proposal is settled against the text
committed after it: how many of its tokens the target's greedy output went on
to repeat, which is what verification would have accepted. The last table
splits the fixed trie's steps by the evidence behind its match: the matched
suffix's length n, and how many of the recent occurrences agree on the
likeliest first token.

Both methods' text is the target's greedy output, so the two runs differ only
in where each speculated; the settled proposals show whether the steps the
controller skipped were the poor ones. Steps are watched through the
scheduler's step-observer hook (`specgraft.infer.StepObserver`); each method
runs its rows one at a time on a scheduler of its own, as `generate_batch`
does (a closed batch). A step's time includes the side proposals, which run
inside it.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict

import specgraft as sg
from specgraft.heads.prompt_lookup import PromptLookupState
from specgraft.infer import Committed, Drafted, StepObserver, Stepped
from specgraft.tools.prompts import encode_prompt, read_prompt_file


def reached(history: list[int], position: int, tree: sg.Tree) -> int:
    """How deep ``tree``, proposed with its root at ``history[position]``, matches the tokens after it."""
    tokens, parents, depth = tree.tokens.tolist(), tree.parent_list, tree.depth_list
    matched, best = {0}, 0
    for i in range(1, len(tokens)):
        at = position + depth[i]
        if parents[i] in matched and at < len(history) and history[at] == tokens[i]:
            matched.add(i)
            best = max(best, depth[i])
    return best


def generate(sched: sg.Scheduler, prompt: list[int], max_new_tokens: int) -> sg.GenerationOutput:
    """One row to its end, as `generate_batch` runs a batch of one (a closed batch)."""
    sched.closed = True
    sched.submit(prompt, max_new_tokens, eos_token_id=())
    output = None
    while not sched.idle:
        for event in sched.step():
            if isinstance(event, sg.Failed):
                raise event.error
            if isinstance(event, sg.Finished):
                output = event.output
    return output


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", required=True)
    parser.add_argument("--prompts", default="../shared/data/story_prompts_dev.jsonl")
    parser.add_argument("--limit", type=int, default=40)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json")
    args = parser.parse_args()
    target = sg.load_target(args.target, threads=args.threads)
    prompts = [encode_prompt(target, p.text) for p in read_prompt_file(args.prompts)][: args.limit]
    max_len = min(max(map(len, prompts)) + args.max_new_tokens, target.max_context)
    methods = {"prompt-lookup": sg.SpeculativeGenerator(target, sg.PromptLookup()),
               "prompt-lookup adaptive": sg.SpeculativeGenerator(target, sg.PromptLookup(), tree=sg.Adaptive())}
    methods = {name: gen.scheduler(max_batch_size=1, max_len=max_len) for name, gen in methods.items()}

    # Per step: the method, whether a tree was verified, seconds, nodes, tokens accepted; the trie's evidence.
    arm: list[str] = [""]
    steps: dict[tuple[str, bool], list[float]] = defaultdict(lambda: [0, 0.0, 0, 0])
    side: list[tuple[int, sg.Tree]] = []  # this generation's proposals on the side: (root position, tree)
    match: list[tuple[int, int]] = [(0, 0)]  # the trie's last match: (n, occurrences agreeing on its first token)
    evidence: dict[tuple[int, int], list[float]] = defaultdict(lambda: [0, 0])  # -> steps, tokens accepted

    continuations, longest_match = PromptLookupState._continuations, PromptLookupState._longest_match

    def match_seen(self, root_token):
        n, ends = longest_match(self, root_token)
        match[0] = (n, 0)
        return n, ends

    def continuations_seen(self, root_token, depth):
        found = continuations(self, root_token, depth)
        firsts = [b[0] for b in found if b]
        match[0] = (match[0][0], max(map(firsts.count, firsts), default=0))
        return found

    PromptLookupState._continuations, PromptLookupState._longest_match = continuations_seen, match_seen

    class Watch(StepObserver):
        """Each step into ``steps`` (the fixed trie's also into ``evidence``); adaptive's skipped proposals into
        ``side``."""

        nodes = accepted = 0  # the step's draft nodes verified and tokens accepted

        def drafted(self, step: Drafted) -> None:
            if arm[0] == "prompt-lookup adaptive":
                for request in step.rows:  # (their state before this step's commit)
                    if request.draft is not None and not request.drafted:
                        proposed = request.draft.propose(request.root, None, request.draft.lookup.num_tokens)
                        side.append((len(request.cache), proposed))

        def committed(self, step: Committed) -> None:
            self.nodes = sum(row.draft_tokens for row in step.rows)
            self.accepted = sum(row.accepted for row in step.rows)

        def stepped(self, step: Stepped) -> None:
            tree = self.nodes > 0
            row = steps[(arm[0], tree)]
            row[0] += 1
            row[1] += step.seconds
            row[2] += self.nodes
            row[3] += self.accepted
            if tree and arm[0] == "prompt-lookup":
                evidence[match[0]][0] += 1
                evidence[match[0]][1] += self.accepted
            self.nodes = self.accepted = 0

    for name, sched in methods.items():
        sched.add_observer(Watch())
        arm[0] = name  # warm-up
        for prompt in prompts[:2]:
            generate(sched, prompt, 8)
    steps.clear()
    evidence.clear()
    # adaptive's steps without a tree where lookup matched: steps, tokens it would have accepted, nodes
    skipped = [0, 0, 0]
    wall, tokens = dict.fromkeys(methods, 0.0), dict.fromkeys(methods, 0)
    for _ in range(args.rounds):
        for i, prompt in enumerate(prompts):
            order = list(methods) if i % 2 == 0 else list(reversed(methods))
            for name in order:
                arm[0] = name
                side.clear()
                start = time.perf_counter()
                out = generate(methods[name], prompt, args.max_new_tokens)
                wall[name] += time.perf_counter() - start
                tokens[name] += len(out.token_ids)
                history = list(prompt) + list(out.token_ids)
                for position, tree in side:
                    if tree.num_nodes > 1:
                        skipped[0] += 1
                        skipped[1] += reached(history, position, tree)
                        skipped[2] += tree.num_nodes - 1
    rows = [{"method": name, "tree verified": tree, "steps": int(n), "us per step": s / n * 1e6,
             "nodes per step": nodes / n, "accepted per step": acc / n}
            for (name, tree), (n, s, nodes, acc) in sorted(steps.items()) if n]
    rate = {name: tokens[name] / wall[name] for name in methods}
    print("| method | tokens/s | x the trie |\n|---|---:|---:|")
    for name in methods:
        print(f"| {name} | {rate[name]:.1f} | {rate[name] / rate['prompt-lookup']:.3f} |")
    print("\n| method | tree verified | steps | us per step | nodes per step | accepted per step |")
    print("|---|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['method']} | {'yes' if r['tree verified'] else 'no'} | {r['steps']} | {r['us per step']:.0f} | "
              f"{r['nodes per step']:.2f} | {r['accepted per step']:.2f} |")
    if skipped[0]:
        print(f"\nAdaptive steps without a tree where lookup matched: {skipped[0]}; settled against the text, "
              f"its whole trie ({skipped[2] / skipped[0]:.1f} nodes) would have accepted "
              f"{skipped[1] / skipped[0]:.2f} tokens each.")
    print("\n| fixed trie's match: n | occurrences agreeing | steps | accepted per step |")
    print("|---:|---:|---:|---:|")
    for (n, agree), (count, acc) in sorted(evidence.items()):
        print(f"| {n} | {agree} | {count} | {acc / count:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tokens_per_s": rate, "steps": rows, "skipped": skipped,
                       "evidence": [[n, a, c, t] for (n, a), (c, t) in sorted(evidence.items())]}, f, indent=2)


if __name__ == "__main__":
    main()

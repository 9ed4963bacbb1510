"""trainer3d.engine, through its public calls only, against transformers: per-token log-probabilities (and entropies)
of packed rows equal transformers' log-softmax of the same model run on each document alone, at one process, tp2·pp2,
ZeRO-3 at dp4 and (Qwen3-MoE) dp2·ep2; a policy-gradient loss written here (ratio clip, advantages per row) trained
through forward_backward/step equals transformers' model trained by torch's AdamW on the same loss, per step, in loss
and gradient norm, under token-mean, sequence-mean and sum (1p, tp2·pp2, ZeRO-3 dp4), at a rollout temperature and
with an entropy bonus whose gradient flows (log-probabilities and entropies at the temperature checked apart); the weights streamed by
named_weights() are the reference's after training; save -> load gives the same log-probabilities. Rollouts of any
count and length (a list of sequences, packed into two passes) give each sequence's log-probs and entropies as if run
alone, and train (one call; then the batch split over two calls with batch_total) as the reference does sequence by
sequence, also at ZeRO-1 dp2·pp2 and ZeRO-2 dp4, whose accumulation boundary the engine holds until step(). The
weight stream in bf16 and 4 KiB buckets equals the fp32 stream at every layout, and the MoE's per-expert tensors
equal transformers' saved file under its names. Misuse (float or
out-of-vocabulary ids, a mask or field of another shape, a loss_fn that returns a scalar) is refused on every rank at
tp2·pp2 and changes nothing. The reference shares no code with trainer3d."""

from __future__ import annotations

import sys

import torch

from helpers.distributed import run_world
from helpers.parity import PARAM_ATOL
from test_llama import hf_llama
from test_llama_hf import hf_moe
from trainer3d.config import TrainConfig

VOCAB, SEQ, GB, LR, CLIP = 1000, 32, 8, 2e-3, 1.0
TEMPERATURE, ENTROPY_COEF = 0.8, 1.0  # the rollout's temperature; an entropy bonus in the trained loss, strong
# enough to move the gradient norm (near-uniform distributions: the entropy's gradient is small)
AGGREGATIONS = ["token-mean", "sequence-mean", "sum", "token-mean"]  # one per step
ROLLOUT_STEPS = ["sequence-mean", "token-mean"]  # then rollouts: one call, then the batch split over two calls


def batch(seed: int = 0):
    """Rows of two documents each (the cut at a random place), a response mask that starts at a random place and
    leaves out the position whose next token opens the second document, per-row advantages, and old log-probs
    (the current ones moved by noise, so that the ratio clip is active)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (GB, SEQ + 1), generator=g)
    cuts = torch.randint(8, 24, (GB,), generator=g)
    documents = (torch.arange(SEQ + 1)[None, :] >= cuts[:, None]).long()
    starts = torch.randint(2, 16, (GB,), generator=g)
    mask = torch.arange(SEQ)[None, :] >= starts[:, None]
    mask &= documents[:, :-1] == documents[:, 1:]  # not across documents
    advantages = torch.randn(GB, 1, generator=g)
    noise = 0.3 * torch.randn(GB, SEQ, generator=g)
    return tokens, documents, mask, advantages, noise


def rollouts(seed: int, n: int = 13):
    """Rollouts of mixed lengths (10 to SEQ + 1 tokens: more rows than one pass of GB holds), each with a response
    mask from a random start, an advantage (one number) and noise for its old log-probs."""
    g = torch.Generator().manual_seed(100 + seed)
    lengths = torch.randint(10, SEQ + 2, (n,), generator=g).tolist()
    sequences = [torch.randint(0, VOCAB, (length,), generator=g) for length in lengths]
    masks = [torch.arange(length - 1) >= int(torch.randint(0, length // 2, (1,), generator=g)) for length in lengths]
    advantages = torch.randn(n, generator=g).tolist()
    noise = [0.3 * torch.randn(length - 1, generator=g) for length in lengths]
    return sequences, masks, advantages, noise


def reference_sequence(model, sequence, temperature: float = 1.0):
    """(log-probs, entropies) [len - 1] of one sequence run alone under softmax(logits / temperature)."""
    logp = torch.log_softmax(model(sequence[None]).logits[0, :-1].float() / temperature, -1)
    return logp.gather(-1, sequence[1:, None])[:, 0], -(logp.exp() * logp).sum(-1)


def reference_rollout_loss(model, data, aggregation):
    """The aggregated loss of rollouts by its definition, sequence by sequence: token-mean Σ_i Σ_t m·l / Σ_i Σ_t m;
    sequence-mean the mean over sequences of Σ_t m·l / Σ_t m."""
    sequences, masks, advantages, noise = data
    sums, counts = [], []
    for seq, m, adv, eps in zip(sequences, masks, advantages, noise):
        with torch.no_grad():
            old = reference_sequence(model, seq, TEMPERATURE)[0] + eps
        lp, ent = reference_sequence(model, seq, TEMPERATURE)
        losses = rl_loss(lp, {"old": old, "adv": torch.tensor(adv), "entropy": ent})
        sums.append((losses * m).sum())
        counts.append(m.sum())
    if aggregation == "token-mean":
        return torch.stack(sums).sum() / torch.stack(counts).sum()
    return torch.stack([s / c for s, c in zip(sums, counts)]).mean()


def pg_loss(logprobs, fields):
    """PPO/GRPO's clipped surrogate, per token."""
    ratio = torch.exp(logprobs - fields["old"])
    return -torch.min(ratio * fields["adv"], ratio.clamp(0.8, 1.2) * fields["adv"])


def rl_loss(logprobs, fields):
    """The clipped surrogate with an entropy bonus (the entropy's gradient flows)."""
    return pg_loss(logprobs, fields) - ENTROPY_COEF * fields["entropy"]


def reference_logprobs(model, tokens, documents, temperature: float = 1.0, entropy: bool = False):
    """[B, T] log p(tokens[:, t+1]) under softmax(logits / temperature) from each document run alone (0 where t+1
    opens the next document); with `entropy`, also each such position's entropy."""
    out, ent = torch.zeros(tokens.shape[0], tokens.shape[1] - 1), torch.zeros(tokens.shape[0], tokens.shape[1] - 1)
    for b in range(tokens.shape[0]):
        cut = int((documents[b] == 0).sum())
        for s, e in [(0, cut), (cut, tokens.shape[1])]:
            logp = torch.log_softmax(model(tokens[b:b + 1, s:e]).logits[0, :-1].float() / temperature, -1)
            out[b, s:e - 1] = logp.gather(-1, tokens[b, s + 1:e, None])[:, 0]
            ent[b, s:e - 1] = -(logp.exp() * logp).sum(-1)
    return (out, ent) if entropy else out


def reference_aggregate(losses, mask, documents, aggregation):
    """token-mean, sum, and sequence-mean as GRPO defines it: 1/G Σ_i 1/|o_i| Σ_t over the G sequences (here each
    document of a row: a token belongs to the document its context is in), not over the rows."""
    m = mask.float()
    if aggregation == "token-mean":
        return (losses * m).sum() / m.sum()
    if aggregation == "sequence-mean":
        means = []
        for b in range(losses.shape[0]):
            for d in documents[b, :-1].unique():
                tokens = m[b] * (documents[b, :-1] == d)
                if tokens.sum() > 0:
                    means.append((losses[b] * tokens).sum() / tokens.sum())
        return torch.stack(means).mean()
    return (losses * m).sum()


def test_sequence_mean_weighs_each_packed_sequence_alike():
    """The packed row of the issue: a 2-token and a 6-token reply in one row, a 4-token one in the other; GRPO weighs
    each of the 3 sequences 1/3, its tokens 1/6, 1/18 and 1/12 (a per-row mean gave the first two 1/8 and 3/8)."""
    from trainer3d.engine import token_weights

    mask = torch.zeros(2, 10, dtype=torch.bool)
    mask[0, 1:3] = mask[0, 4:10] = mask[1, 0:4] = True
    documents = torch.zeros(2, 10, dtype=torch.long)
    documents[0, 3:] = 1
    weights = token_weights(mask, "sequence-mean", documents)
    expected = torch.zeros(2, 10, dtype=torch.float64)
    expected[0, 1:3], expected[0, 4:10], expected[1, 0:4] = 1 / 6, 1 / 18, 1 / 12
    torch.testing.assert_close(weights, expected, rtol=1e-12, atol=0)
    torch.testing.assert_close(token_weights(mask, "sequence-mean")[0, 1:3], torch.full((2,), 1 / 16,
                               dtype=torch.float64))  # unpacked rows: a row is one sequence


def test_packed_rollouts_keep_their_own_documents():
    """Three rollouts in one row, given in another order than the row holds them (the longest first): each gets a
    document of its own in the row's order, its tokens are real, and only the row's tail is padding."""
    from trainer3d.engine.batch import pack

    lengths = [4, 10, 6]  # placed at 16, 0 and 10 of a row of 21
    packing = pack(lengths, rows=2, width=21, dp=1, several_a_row=True)
    assert packing.passes == 1 and packing.place == [(0, 0, 16), (0, 0, 0), (0, 0, 10)]
    tokens, documents, real = packing.tokens([torch.full((n,), n) for n in lengths])
    assert documents[0, 0].tolist() == [0] * 10 + [1] * 6 + [2] * 4 + [21]
    assert tokens[0, 0, :20].tolist() == [10] * 10 + [6] * 6 + [4] * 4
    assert real[0, 0].all() and not real[0, 1].any()


def reference_run(model, data):
    """transformers' model, torch's AdamW (decay on matrices only) at a constant lr, clip_grad_norm_: per step the
    aggregated loss and the norm; the seq-mean and token-mean norms of step 1 at the same weights."""
    params = list(model.parameters())
    opt = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
                             {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                            lr=LR, betas=(0.9, 0.95), eps=1e-8)
    losses, norms, first = [], [], {}
    for step, aggregation in enumerate(AGGREGATIONS + ROLLOUT_STEPS):
        if step >= len(AGGREGATIONS):  # rollouts of any shape
            loss = reference_rollout_loss(model, data[step], aggregation)
            loss.backward()
            norms.append(torch.nn.utils.clip_grad_norm_(params, CLIP).item())
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
            continue
        tokens, documents, mask, adv, noise = data[step]
        with torch.no_grad():
            old = reference_logprobs(model, tokens, documents, TEMPERATURE) + noise
        lp, entropy = reference_logprobs(model, tokens, documents, TEMPERATURE, entropy=True)
        per_token = rl_loss(lp, {"old": old, "adv": adv, "entropy": entropy})
        if step == 0:
            without = reference_aggregate(pg_loss(lp, {"old": old, "adv": adv}), mask, documents, aggregation)
            for other, loss in [(other, reference_aggregate(per_token, mask, documents, other))
                                for other in ("token-mean", "sequence-mean")] + [("no entropy", without)]:
                grads = torch.autograd.grad(loss, params, retain_graph=True)
                first[other] = torch.cat([g.flatten() for g in grads]).norm().item()
        loss = reference_aggregate(per_token, mask, documents, aggregation)
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(params, CLIP).item())
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, norms, first


def refusals(engine, tokens, documents) -> list[str]:
    """Misuse, refused on every rank alike: before any pass, or after it where only the last stage can tell (a loss
    of another shape); the engine is as it was after each (no gradient left, the same log-probs)."""
    from trainer3d.errors import ConfigError, TrainingError

    before = engine.logprobs(tokens, documents)
    said = []
    for call in (lambda: engine.logprobs(tokens.float(), documents),
                 lambda: engine.logprobs(tokens + VOCAB, documents),
                 lambda: engine.forward_backward(tokens, lambda lp, f: -lp, mask=torch.ones(GB, SEQ - 1)),
                 lambda: engine.forward_backward(tokens, pg_loss, fields={"old": before, "adv": torch.ones(GB)},
                                                 documents=documents),
                 lambda: engine.forward_backward(tokens, lambda lp, f: -lp.sum(), documents=documents),
                 lambda: engine.logprobs([tokens[0], tokens[1, :1]]),
                 lambda: engine.forward_backward([tokens[0, :5]], pg_loss, mask=[torch.ones(5)], fields={"old": [0.0]}),
                 lambda: engine.forward_backward([tokens[0, :5]], pg_loss, fields={"old": [0.0], "adv": 1.0})):
        try:
            call()
            said.append("accepted")
        except ConfigError as e:
            said.append(str(e))
    try:
        engine.step()
        said.append("stepped")
    except TrainingError as e:
        said.append(str(e))
    said.append(torch.equal(engine.logprobs(tokens, documents), before))
    return said


def refused(call) -> str:
    """The sentence a call is refused with (ConfigError, TrainingError), or "accepted"."""
    from trainer3d.errors import ConfigError, TrainingError

    try:
        call()
        return "accepted"
    except (ConfigError, TrainingError) as e:
        return str(e)


def fails_on_real_rows(logprobs, fields):
    """A loss_fn that raises inside the pass (the engine's probe, a [1, 2] stand-in, passes)."""
    if tuple(logprobs.shape) != (1, 2):
        raise ValueError("the reward model went away")
    return -logprobs


def raised(call) -> str:
    """`ExceptionType: message` of what a call raised, or "nothing"."""
    try:
        call()
        return "nothing"
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"


def rollout_step(engine, data, aggregation: str, calls: int) -> float:
    """forward_backward over rollouts of any shape: in one call, or split over `calls` calls that name the whole
    batch's total (its masked tokens, or its sequences); between two calls, one with a loss_fn that returns a scalar,
    refused before any pass: the step's gradient is the calls' (which equal the reference's) at every engine."""
    sequences, masks, advantages, noise = data
    old = [lp + eps for lp, eps in zip(engine.logprobs(sequences, temperature=TEMPERATURE), noise)]
    total = sum(int(m.sum()) for m in masks) if aggregation == "token-mean" else len(sequences)
    loss = 0.0
    for part in torch.arange(len(sequences)).tensor_split(calls):
        pick = part.tolist()
        loss = engine.forward_backward([sequences[i] for i in pick], rl_loss, mask=[masks[i] for i in pick],
                                       fields={"old": [old[i] for i in pick], "adv": [advantages[i] for i in pick]},
                                       aggregation=aggregation, temperature=TEMPERATURE, entropy=True,
                                       batch_total=total if calls > 1 else None)
        if calls > 1 and pick[0] == 0:
            said = refused(lambda: engine.forward_backward([sequences[0]], lambda lp, f: -lp.sum()))
            assert said.startswith("loss_fn must return one loss per token"), said
    return loss


def _engine_run(hf_dir, layout, data, train, tmp):
    from trainer3d.engine import Engine

    layout = dict(layout)
    n = layout.get("tp", 1) * layout.get("pp", 1) * layout.pop("dp", 1)
    cfg = TrainConfig(init_from_hf=hf_dir, seq_len=SEQ, global_batch=GB, micro_batches=2, precision="fp32",
                      lr=LR, warmup_steps=0, min_lr=LR, max_steps=100, grad_clip=CLIP, weight_decay=0.1,
                      document_mask=True, reset_position_ids=True, out_dir=tmp, **layout)
    engine = Engine(cfg, ranks=list(range(n)))
    out = None
    if engine.active:
        tokens, documents = data[0][0], data[0][1]
        lp, entropy = engine.logprobs(tokens, documents, entropy=True)
        out = {"logprobs": lp, "entropy": entropy,
               "tempered": engine.logprobs(tokens, documents, entropy=True, temperature=TEMPERATURE),
               "rollouts": engine.logprobs(data[len(AGGREGATIONS)][0], entropy=True, temperature=TEMPERATURE)}
        if train:
            out["losses"], out["norms"] = [], []
            for step, aggregation in enumerate(AGGREGATIONS):
                tokens, documents, mask, adv, noise = data[step]
                old = engine.logprobs(tokens, documents, temperature=TEMPERATURE) + noise
                if step == 1:  # a call abandoned (discard): its gradient leaves no trace in the step's
                    engine.forward_backward(tokens, rl_loss, mask=mask, aggregation=aggregation, documents=documents,
                                            fields={"old": old, "adv": -3 * adv}, temperature=TEMPERATURE, entropy=True)
                    engine.discard()
                    out["raised"] = raised(lambda: engine.forward_backward(tokens, fails_on_real_rows,
                                                                           documents=documents))
                out["losses"].append(engine.forward_backward(
                    tokens, rl_loss, mask=mask, aggregation=aggregation, fields={"old": old, "adv": adv},
                    documents=documents, temperature=TEMPERATURE, entropy=True))
                out["norms"].append(engine.step()["grad_norm"])
                # between steps, to the host and back: the steps after it still equal the reference's (a config that
                # offloads already is refused)
                if step == 0 and "offload" not in (cfg.deepspeed_config or ""):
                    out["offloaded"] = engine.offload()
                    out["offload_refusal"] = refused(lambda: engine.logprobs(tokens, documents))
                    engine.onload()
            for step, aggregation in enumerate(ROLLOUT_STEPS, start=len(AGGREGATIONS)):
                out["losses"].append(rollout_step(engine, data[step], aggregation, calls=1 + step % 2))
                out["norms"].append(engine.step()["grad_norm"])
            if layout.get("pp", 1) > 1:
                out["refusals"] = refusals(engine, tokens, documents)
            out["weights"] = dict(engine.named_weights())
            out["received"] = engine._stream.received
            engine._stream.everywhere = {torch.float32: set()}  # every tensor from its writers: what the reads replace
            out["sent"] = dict(engine.named_weights())
            before = engine.logprobs(tokens, documents)
            engine.load(engine.save(tmp))
            out["reloaded"] = (engine.logprobs(tokens, documents) - before).abs().max().item()
        # in bf16, in buckets of 4 KiB (units split across buckets and a unit larger than one): as the fp32 stream
        out["bf16"] = dict(engine.named_weights(torch.bfloat16, bucket_bytes=1 << 12))
    engine.close()
    return out


def _world(rank, world_size, runs, data, tmp):
    return {label: _engine_run(hf_dir, layout, data, train, f"{tmp}/{label.replace(' ', '_')}")
            for label, (hf_dir, layout, train) in runs.items()}


def test_engine_against_transformers(tmp_path):
    llama, moe = hf_llama(seed=3), hf_moe("qwen3", seed=3)
    llama.save_pretrained(tmp_path / "llama")
    moe.save_pretrained(tmp_path / "moe")
    data = [batch(seed) for seed in range(len(AGGREGATIONS))] + [rollouts(seed) for seed in range(len(ROLLOUT_STEPS))]
    runs = {"1p": (str(tmp_path / "llama"), {}, True),
            "tp2 pp2": (str(tmp_path / "llama"), dict(tp=2, pp=2), True),
            # DDP: every rank holds every weight, and its stream reads them where they are (nothing received)
            "dp2": (str(tmp_path / "llama"), dict(dp=2), True),
            "moe dp2 ep2": (str(tmp_path / "moe"), dict(dp=2, ep=2), False),
            "zero3 dp4": (str(tmp_path / "llama"), dict(dp=4, deepspeed_config="ds_configs/zero3.json"), True),
            # ZeRO-1/2 reduce at DeepSpeed's accumulation boundary, which the engine holds back until step()
            "zero1 dp2 pp2": (str(tmp_path / "llama"), dict(dp=2, pp=2, deepspeed_config="ds_configs/zero1.json"), True),
            "zero2 dp4": (str(tmp_path / "llama"), dict(dp=4, deepspeed_config="ds_configs/zero2.json"), True),
            # (its host copies and its partitions: what a discarded call left there too)
            "zero3 offload dp4": (str(tmp_path / "llama"), dict(dp=4, deepspeed_config="ds_configs/zero3_offload.json"),
                                  True)}
    every_rank = run_world(4, _world, runs, data, str(tmp_path / "runs"), timeout=600)
    results, last = every_rank[0], data[len(AGGREGATIONS) - 1][0]
    # a loss_fn raising inside a pass: its error on the last stage's ranks, one sentence on the others, after every
    # stage's backward ran (no rank left waiting); the step's gradient so far dropped (the norms below still match)
    for rank, result in enumerate(every_rank):
        for label, run in result.items():
            if run is not None and "raised" in run:
                last_stage = "pp" not in label or rank >= 2
                assert run["raised"] == ("ValueError: the reward model went away" if last_stage else
                                         "TrainingError: loss_fn raised on the last pipeline stage (its ranks raise "
                                         "the error); the step's gradient so far is dropped."), (label, rank, run)
    for rank, result in enumerate(every_rank):  # tp2·pp2: ranks 0-1 hold the first stage, 2-3 the last
        shape = "a tensor of shape []"  # (seen before any pass, on every rank)
        assert result["tp2 pp2"]["refusals"] == [
            "tokens must be integer token ids; got torch.float32.",
            f"tokens must be ids in [0, {VOCAB}) (the model's vocabulary); got ids from {int(last.min()) + VOCAB} "
            f"to {int(last.max()) + VOCAB}.",
            f"mask must be a tensor [{GB}, {SEQ}] (global_batch, seq_len: one value per predicted token); got "
            f"[{GB}, {SEQ - 1}].",
            f"fields['adv'] must be a tensor [{GB}, {SEQ}] or [{GB}, 1] (global_batch, seq_len: one value per predicted "
            f"token, or per row); got [{GB}].",
            f"loss_fn must return one loss per token, a tensor shaped like its logprobs argument ([micro-batch rows, "
            f"tokens]); it returned {shape}.",
            f"rollout 1 has 1 tokens; a rollout holds 2 to seq_len + 1 = {SEQ + 1} (raise seq_len, or cut it).",
            "mask[0] must be a tensor [4] (one value per predicted token of rollout 0); got [5].",
            "fields['adv'] must be a list of 1 values, one per rollout; got a float.",
            "step() without a forward_backward since the last step: there is no gradient.", True], rank

    tokens, documents = data[0][0], data[0][1]
    with torch.no_grad():
        for label, model in (("1p", llama), ("tp2 pp2", llama), ("moe dp2 ep2", moe), ("zero3 dp4", llama)):
            model.train(False)
            ref = reference_logprobs(model, tokens, documents)
            scored = documents[:, :-1] == documents[:, 1:]
            gap = (results[label]["logprobs"] - ref)[scored].abs().max().item()
            print(f"{label}: max |logprob - transformers'| {gap:.1e}")
            assert gap < 2e-6, (label, gap)
    with torch.no_grad():  # rollouts of any shape, packed into passes: each sequence as if run alone
        for label, model in (("1p", llama), ("tp2 pp2", llama), ("moe dp2 ep2", moe), ("zero3 dp4", llama)):
            got_lp, got_entropy = results[label]["rollouts"]
            refs = [reference_sequence(model, s, TEMPERATURE) for s in data[len(AGGREGATIONS)][0]]
            gaps = [max((a - r[0]).abs().max().item() for a, r in zip(got_lp, refs)),
                    max(((a - r[1]).abs().max() / r[1].abs().max()).item() for a, r in zip(got_entropy, refs))]
            print(f"{label}: rollouts' max |logprob - transformers'| {gaps[0]:.1e}, entropy rel {gaps[1]:.1e}")
            assert [len(x) for x in got_lp] == [len(s) - 1 for s in data[len(AGGREGATIONS)][0]]
            assert gaps[0] < 2e-6 and gaps[1] < 1e-6, (label, gaps)
    with torch.no_grad():  # the entropy of position 0's distribution (always inside the first document)
        probs = torch.log_softmax(llama(tokens[:, :1]).logits[:, 0].float(), -1)
        assert torch.allclose(results["1p"]["entropy"][:, 0], -(probs.exp() * probs).sum(-1), atol=2e-6)
        llama.train(False)
        ref_lp, ref_entropy = reference_logprobs(llama, tokens, documents, TEMPERATURE, entropy=True)
        scored = documents[:, :-1] == documents[:, 1:]
        for label in ("1p", "tp2 pp2"):  # the rollout's distribution, softmax(logits / temperature)
            lp, entropy = results[label]["tempered"]
            gaps = [(lp - ref_lp)[scored].abs().max().item(),  # absolute; the entropy's relative (it is ~ln V)
                    ((entropy - ref_entropy)[scored].abs().max() / ref_entropy[scored].abs().max()).item()]
            assert gaps[0] < 2e-6 and gaps[1] < 1e-6, (label, gaps)
            assert (lp - results[label]["logprobs"])[scored].abs().max() > 0.1  # the temperature acts

    from safetensors.torch import load_file

    on_disk = load_file(tmp_path / "moe" / "model.safetensors")  # transformers' per-expert names (fused in memory)
    for label, run in results.items():  # the bucketed bf16 stream: whole tensors, HF's names (per expert: the MoE's)
        expected = run["weights"] if "weights" in run else on_disk
        assert sorted(run["bf16"]) == sorted(expected), label
        assert all(torch.equal(run["bf16"][k], v.to(torch.bfloat16)) for k, v in expected.items()), label
    losses, norms, first = reference_run(llama.train(), data)
    print(f"transformers: losses {losses}, norms {norms}; step 1's norm token-mean {first['token-mean']:.6f}, "
          f"sequence-mean {first['sequence-mean']:.6f}")
    assert abs(first["token-mean"] - first["sequence-mean"]) > 0.01 * first["token-mean"]  # they differ
    # the bonus's gradient counts: 100x the comparison's tolerance (1e-5) apart from the norm without it (1.3e-3)
    assert abs(first["no entropy"] - first["token-mean"]) > 1e-3 * first["token-mean"]
    assert max(norms) > CLIP  # clipping was active at some step
    state = llama.state_dict()
    for label in ("1p", "tp2 pp2", "dp2", "zero3 dp4", "zero1 dp2 pp2", "zero2 dp4", "zero3 offload dp4"):
        run = results[label]
        loss_rel = max(abs(a - b) / abs(b) for a, b in zip(run["losses"], losses))
        norm_rel = max(abs(a - b) / b for a, b in zip(run["norms"], norms))
        weights = max((run["weights"][k] - v).abs().max().item() for k, v in state.items())
        print(f"{label}: loss rel diff {loss_rel:.1e}, norm rel diff {norm_rel:.1e}, weights {weights:.1e}, "
              f"after save -> load {run['reloaded']:.1e}")
        assert loss_rel < 1e-5 and norm_rel < 1e-5, (label, run["losses"], run["norms"])
        # the parity rule's bound on weights (tests/helpers/parity.py): AdamW moves an element whose gradient is ~0 by up to
        # lr on rounding alone (1.1e-5 at tp 2 x pp 2 on an AVX-512 machine)
        assert sorted(run["weights"]) == sorted(state) and weights < PARAM_ATOL, (label, weights)
        assert run["reloaded"] == 0.0
        # a DDP replica (ZeRO-2's fp32 parameters too) streams from its own parameters, bitwise what their writers send;
        # a split model's ranks receive what they do not hold
        assert (run["received"] == 0) == (label in ("1p", "dp2", "zero2 dp4")), (label, run["received"])
        assert all(torch.equal(run["sent"][k], v) for k, v in run["weights"].items()), label
        if "offload" in label:
            continue
        assert run["offload_refusal"] == "The engine is offloaded: call onload() before its other calls."
        if "zero" in label:  # DeepSpeed reports what its engines held: the steps after the round trip still match
            assert run["offloaded"]["param_bytes"] > 0 and run["offloaded"]["optim_bytes"] > 0, run["offloaded"]
        else:  # on a CPU, DDP has nothing to move: the device is the host
            assert run["offloaded"] == {"param_bytes": 0, "grad_bytes": 0, "optim_bytes": 0}, run["offloaded"]


def test_grpo_loss_clips_as_ppo_defines_it():
    """The example's per-token loss: -min(ρA, clip(ρ, 1 ± ε)A) + β·k3. Where the clip holds the ratio (ρ > 1 + ε with
    A > 0, ρ < 1 - ε with A < 0) the surrogate's gradient in logp is 0; elsewhere it is -ρA. Fails without the clip
    (every gradient -ρA) or with the advantage's sign flipped."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("grpo_example", "examples/grpo/grpo.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    grpo_loss = example.grpo_loss

    ratio = torch.tensor([1.5, 0.5, 1.5, 0.5, 1.1, 0.9])
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0, 2.0, -2.0])
    old = torch.zeros(6)
    logp = ratio.log().requires_grad_(True)
    loss = grpo_loss(clip=0.2, kl_coef=0.0)(logp, {"old": old, "adv": adv, "ref": logp.detach()})
    loss.sum().backward()
    expected = torch.tensor([-1.2, -0.5, 1.5, 0.8, -2.2, 1.8])  # -min(ρA, clip(ρ)A), written out
    assert torch.allclose(loss, expected), loss
    held = torch.tensor([True, False, False, True, False, False])  # 1.5 > 1.2 with A > 0; 0.5 < 0.8 with A < 0
    assert torch.equal(logp.grad == 0, held), logp.grad
    assert torch.allclose(logp.grad[~held], -(ratio * adv)[~held]), logp.grad


def test_grpo_example(tmp_path):
    """examples/grpo end to end: an SFT export made as a user makes one (sft.py: trainer3d's chat SFT of a small
    Llama with the GPT-2 tokenizer, then trainer3d.export), then GRPO on it at one process: replies end at eos with
    lengths that vary, four updates a step make the ratio leave 1 (the clip holds some tokens), and the reward and
    the share of exact replies rise over 16 steps (they fall with the advantage's sign flipped); under torchrun at
    tp 2 its first steps are the one process's (rewards and gradient norms)."""
    import json
    import subprocess

    from helpers.distributed import free_port, launch_env

    env = launch_env()
    p = subprocess.run([sys.executable, "examples/grpo/sft.py", "--out-dir", str(tmp_path / "sft")], env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    cmd = [sys.executable, "examples/grpo/grpo.py", "--model", str(tmp_path / "sft" / "hf"), "--steps", "16",
           "--out-dir", str(tmp_path / "grpo")]
    p = subprocess.run(cmd, env={**env, "MASTER_PORT": str(free_port())}, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    records = [json.loads(line) for line in open(tmp_path / "grpo" / "grpo.jsonl")]
    assert [r["step"] for r in records] == list(range(1, 17))
    first, last = records[:5], records[-5:]
    mean = lambda rs, k: sum(r[k] for r in rs) / len(rs)  # noqa: E731
    assert mean(last, "reward") > mean(first, "reward") + 0.02, [r["reward"] for r in records]
    assert mean(last, "exact") > mean(first, "exact") + 0.05, [r["exact"] for r in records]
    assert records[0]["kl"] < 1e-5 < records[-1]["kl"]  # the rollout side scores as the engine does, then it moves
    assert all(r["ended"] > 0.9 and r["reply_tokens_max"] > r["reply_tokens"] for r in records), records
    assert sum(r["clipped"] > 0 for r in records) >= 8, [r["clipped"] for r in records]
    # under torchrun at tp 2 (rank 0 samples and scores, every rank trains on what it broadcasts): the same steps
    cmd = ["torchrun", "--nproc_per_node", "2", f"--master_port={free_port()}", *cmd[1:4], "--steps", "2", "--tp",
           "2", "--out-dir", str(tmp_path / "grpo_tp2")]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    tp2 = [json.loads(line) for line in open(tmp_path / "grpo_tp2" / "grpo.jsonl")]
    for a, b in zip(records[:2], tp2, strict=True):
        assert a["reward"] == b["reward"] and abs(a["grad_norm"] - b["grad_norm"]) < 1e-5 * a["grad_norm"], (a, b)

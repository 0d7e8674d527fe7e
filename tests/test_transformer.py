"""Transformer: shapes, precision of the attention Cells, real optimizer steps, tokenizer, readers, beam search
against brute force, BLEU, checkpoint averaging, and the recipe end to end with eval.py."""
import gzip
import itertools
import json
import math

import mindspore as ms
import mindspore.nn as nn
import numpy as np
import pytest
import sacrebleu
from omegaconf import OmegaConf

from ampzoo.amp.names import portable
from ampzoo.amp.loss_scale import AmpTrainStep, plan_loss_scale
from ampzoo.amp.policy import apply_policy
from ampzoo.amp.precision import precision_report
from ampzoo.data.translation import BOS, EOS, read_pairs, tokenizer
from ampzoo.engine.metrics import FlatCrossEntropy, NetWithLoss
from ampzoo.models import create_model
from ampzoo.models.decoding import beam_search, bleu, greedy, length_penalty, scores
from tests.conftest import ROOT, run_cli
from ampzoo.compose import compose
from ampzoo.errors import ConfigError

TINY = dict(d_model=32, heads=4, ffn=64, encoder_layers=1, decoder_layers=1, dropout=0.0, max_len=32)


def tiny_batch(vocab=50, b=4, s=9, t=7):
    rng = np.random.RandomState(0)
    return (ms.Tensor(rng.randint(4, vocab, (b, s)).astype(np.int32)),
            ms.Tensor(rng.randint(4, vocab, (b, t)).astype(np.int32)),
            ms.Tensor(rng.randint(4, vocab, (b, t)).astype(np.int32)))


def test_forward_shape(graph_mode):
    net = create_model("transformer", num_classes=50, **TINY)
    src, tgt_in, _ = tiny_batch()
    assert net(src, tgt_in).shape == (4 * 7, 50)  # flat: one row per target position


def test_recipe_keeps_layernorm_and_softmax_fp32():
    cfg = compose(["recipe=transformer_base_o2"])
    net, policy = apply_policy(create_model("transformer", num_classes=100, **TINY), cfg.amp)
    rows = precision_report(net, policy)["cells"]
    by_class = {}
    for r in rows:  # the CPU kernels' Softmax (CpuSoftmax) under the name a keep-list uses
        by_class.setdefault(portable(r["class"]), set()).add(r["compute_dtype"])
    assert by_class["Softmax"] == {"float32"} and by_class["LayerNorm"] == {"float32"}
    assert by_class["BatchMatMul"] == {"float16"} and by_class["Dense"] == {"float16"}


@pytest.mark.parametrize("level,ls", [("O0", "none"), ("O2", "dynamic")])
def test_loss_decreases_on_a_fixed_batch(graph_mode, level, ls):
    ms.set_seed(0)
    amp = OmegaConf.create({"level": level, "dtype": "float16", "keep_fp32": ["LayerNorm", "Softmax"] if level != "O0"
                            else None, "force_fp16": [],
                            "loss_scale": {"type": ls, "scale": 1.0, "drop_overflow_update": False,
                                           "init_scale": 1024.0, "factor": 2, "window": 1000, "min_scale": 1.0}})
    net, _ = apply_policy(create_model("transformer", num_classes=50, **TINY), amp)
    plan = plan_loss_scale(amp.loss_scale)
    opt = nn.Adam(net.trainable_params(), 3e-3, loss_scale=plan.optimizer_loss_scale)
    step = AmpTrainStep(NetWithLoss(net, FlatCrossEntropy(0.1, 0)), opt, plan, "CPU")
    step.set_train()
    batch = tiny_batch()
    losses = [float(step(*batch)[0].asnumpy()) for _ in range(8)]
    assert losses[-1] < losses[0] - 0.5, losses


def test_tokenizer_round_trip():
    cfg = compose(["recipe=transformer_base_o2"])
    smoke = OmegaConf.merge(cfg.dataset, cfg.smoke.dataset)
    sp = tokenizer(smoke)
    for text in ("Add another user", "Änderungen gespeichert.", "Enter a valid date."):
        assert sp.decode(sp.encode(text, "de")) == text
    assert sp.sp.piece_to_id("<s>") == BOS and sp.sp.piece_to_id("</s>") == EOS


def test_published_preparation_lowercases_tokenizes_and_detokenizes(tmp_path):
    """dataset=multi30k_published: the model sees lowercased Moses tokens in a BPE vocabulary of its own, and
    decoding gives detokenized text, so BLEU is scored against the raw references as the default's is."""
    cfg = compose(["recipe=transformer_base_o2"])
    raw = OmegaConf.create(OmegaConf.to_container(OmegaConf.merge(cfg.dataset, cfg.smoke.dataset)))
    raw.params.cache_dir = str(tmp_path)
    option = compose(["recipe=transformer_tiny_multi30k_o0", "dataset=multi30k_published"]).dataset.params
    assert (option.lowercase, option.moses, option.spm_type, option.vocab_size, option.test_prefix) == (
        True, True, "bpe", 10000, "test_2016_flickr")  # Multi30k's files and shapes, the published preparation
    published = OmegaConf.merge(raw, {"params": {"lowercase": True, "moses": True, "spm_type": "bpe"}})
    tok = tokenizer(published)
    text = 'Ihr Konto "Admin" wurde gespeichert.'
    assert tok.prepare(text, "de") == 'ihr konto " admin " wurde gespeichert .'
    assert tok.decode(tok.encode(text, "de")) == 'ihr konto "admin" wurde gespeichert.'
    scored = 'ihr konto " admin " wurde gespeichert .'  # as multi-bleu.perl scores it: lowercased Moses tokens
    assert tok.decode_tokenized(tok.encode(text, "de")) == scored == tok.tokenized(text)
    pieces = [tok.sp.id_to_piece(i) for i in range(4, tok.sp.get_piece_size())]
    assert pieces and not any(piece != piece.lower() for piece in pieces)  # trained on the lowercased text
    cased = tokenizer(raw)  # the default preparation keeps a model of its own beside it, with capitals
    assert cased.decode_tokenized(cased.encode(text, "de")) == scored  # its output tokenized for the same scorer
    assert len(list(tmp_path.glob("spm-*.model"))) == 2
    with pytest.raises(ConfigError, match="spm_type='wordpiece' is not a sentencepiece model type; valid: unigram"):
        tokenizer(OmegaConf.merge(published, {"params": {"spm_type": "wordpiece"}}))


def test_parallel_files_must_align(tmp_path):
    (tmp_path / "train.en").write_text("a\nb\nc\n")
    with gzip.open(tmp_path / "train.de.gz", "wt") as f:
        f.write("x\ny\n")
    cfg = OmegaConf.merge(compose(["recipe=transformer_base_o2"]).dataset, {"path": str(tmp_path)})
    with pytest.raises(ConfigError, match="train.en has 3 lines but .de has 2"):
        read_pairs(cfg, "train")


def table_model(vocab=6, max_len=5, seed=3):
    """A 'model' with fixed weights: next-token log-probs depend on the whole prefix (a hashed table)."""
    rng = np.random.RandomState(seed)
    cache = {}

    def logp(prefix):
        key = tuple(prefix)
        if key not in cache:
            x = rng.randn(vocab) * 2
            cache[key] = x - np.log(np.exp(x).sum())
        return cache[key]

    buffer = {}

    def step(last, t, reorder):  # the search's step protocol: (best k log-probs, their ids) per row
        rows = buffer.get("rows", np.zeros((len(last), 0), np.int32))[reorder]
        buffer["rows"] = rows = np.concatenate([rows, last[:, None]], 1)
        full = np.stack([logp(row) for row in rows])
        full[:, [0, BOS]] = -np.inf
        ids = np.argsort(-full, axis=1, kind="stable")[:, :vocab]
        return np.take_along_axis(full, ids, 1), ids
    return step, logp


def brute_force_best(logp, vocab, max_len, alpha):
    best, best_score = None, -np.inf
    for length in range(0, max_len - 1):
        for body in itertools.product([v for v in range(vocab) if v not in (0, BOS, EOS)], repeat=length):
            seq = [BOS, *body]
            score = sum(logp(seq[: i + 1])[seq[i + 1]] for i in range(len(seq) - 1)) + logp(seq)[EOS]
            score /= length_penalty(length + 1, alpha)
            if score > best_score:
                best, best_score = list(body), score
    return best


def test_beam_search_finds_the_known_best_sequence():
    """With a beam as wide as the number of possible hypotheses (1+3+9+27 here), beam search is exhaustive: it
    must find the brute-force optimum; a narrow beam yields a valid hypothesis."""
    vocab, max_len, alpha = 6, 5, 0.6
    for seed in range(5):
        step, logp = table_model(vocab, max_len, seed)
        got = beam_search(step, batch=1, beam=40, max_len=max_len, alpha=alpha)[0]
        assert got == brute_force_best(logp, vocab, max_len, alpha), seed
        step, _ = table_model(vocab, max_len, seed)
        narrow = beam_search(step, batch=1, beam=2, max_len=max_len, alpha=alpha)[0]
        assert all(t not in (0, BOS, EOS) for t in narrow)
    step, logp = table_model(vocab, max_len, 1)
    assert isinstance(greedy(step, 1, max_len)[0], list)


def per_sentence_beam_search(step, batch, beam, max_len, alpha, form):
    """fairseq's rules, one sentence and one candidate at a time (the reference for the batched search): in
    score order, an EOS candidate finishes a hypothesis (while the sentence has fewer than `beam`), any other
    extends one, until `beam` are extended; a sentence with `beam` finished hypotheses is done."""
    rows = batch * beam
    tokens = np.full((rows, max_len), 0, np.int32)
    tokens[:, 0] = BOS
    scores = np.full((batch, beam), -np.inf)
    scores[:, 0] = 0.0
    finished = [[] for _ in range(batch)]
    reorder = np.arange(rows, dtype=np.int32)
    for t in range(max_len - 1):
        values, ids = step(tokens[:, t], t, reorder)
        k = values.shape[1]
        cand = (scores[:, :, None] + values.reshape(batch, beam, k)).reshape(batch, -1)
        new_tokens, reorder = tokens.copy(), np.arange(rows, dtype=np.int32)
        for b in range(batch):
            kept, done = 0, len(finished[b]) >= beam
            scores[b] = -np.inf
            for idx in np.argsort(-cand[b], kind="stable")[: 2 * beam]:
                if done or kept == beam or not np.isfinite(cand[b, idx]):
                    break
                row, token = b * beam + idx // k, ids[b * beam + idx // k, idx % k]
                if token == EOS:
                    if len(finished[b]) < beam:
                        normalised = cand[b, idx] / length_penalty(t + 1, alpha, form)
                        finished[b].append((normalised, tokens[row, 1:t + 1].tolist()))
                    continue
                new_tokens[b * beam + kept], reorder[b * beam + kept] = tokens[row], row
                new_tokens[b * beam + kept, t + 1], scores[b, kept] = token, cand[b, idx]
                kept += 1
        tokens = new_tokens
        if all(len(f) >= beam for f in finished):
            break
    unfinished = [[(scores[b, j] / length_penalty(max_len - 1, alpha, form), tokens[b * beam + j, 1:].tolist())
                   for j in range(beam) if np.isfinite(scores[b, j])] for b in range(batch)]
    return [max(finished[b] or unfinished[b], key=lambda x: x[0])[1] for b in range(batch)]


def sentence_table_model(batch, beam, vocab, seed):
    """Like table_model, with a table per sentence (row // beam), and every step's inputs recorded."""
    step, _ = table_model(vocab, 0, seed)
    calls = []

    def per_sentence(last, t, reorder):
        calls.append((last.copy(), reorder.copy()))
        sentence = np.arange(len(last)) // beam
        return step(last + (vocab * sentence if t == 0 else 0), t, reorder)  # a per-sentence first token
    return per_sentence, calls


def test_batched_beam_search_follows_the_per_sentence_rules():
    """The vectorised search keeps, finishes and reorders the same hypotheses as the one-candidate-at-a-time
    loop, with the same steps asked of the model, over narrow beams where sentences finish at different times."""
    for seed in range(12):
        batch, beam, max_len = 4, (2, 3, 5)[seed % 3], 7
        for form, alpha in (("fairseq", 1.0), ("gnmt", 0.6)):
            step1, calls1 = sentence_table_model(batch, beam, 6, seed)
            step2, calls2 = sentence_table_model(batch, beam, 6, seed)
            assert beam_search(step1, batch, beam, max_len, alpha, form) == \
                per_sentence_beam_search(step2, batch, beam, max_len, alpha, form), (seed, form)
            assert len(calls1) == len(calls2)
            for (last1, order1), (last2, order2) in zip(calls1, calls2):
                np.testing.assert_array_equal(last1, last2)
                np.testing.assert_array_equal(order1, order2)


@pytest.fixture(scope="module")
def copy_model():
    """A tiny Transformer trained briefly to copy sources of 3-9 tokens: its hypotheses end (EOS) at
    different lengths, which a random model's never do."""
    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_seed(0)
    net = create_model("transformer", num_classes=24, **{**TINY, "encoder_layers": 2, "decoder_layers": 2})
    opt = nn.Adam(net.trainable_params(), 3e-3)
    step = nn.TrainOneStepCell(NetWithLoss(net, FlatCrossEntropy(0.0, 0)), opt)
    step.set_train()
    rng = np.random.RandomState(0)
    for _ in range(60):
        lengths = rng.randint(3, 10, 32)
        body = [rng.randint(4, 24, n) for n in lengths]
        def pad(rows, w):
            return np.stack([np.pad(r, (0, w - len(r))) for r in rows]).astype(np.int32)
        step(ms.Tensor(pad([np.append(b, EOS) for b in body], 12)),
             ms.Tensor(pad([np.insert(b, 0, BOS) for b in body], 12)),
             ms.Tensor(pad([np.append(b, EOS) for b in body], 12)))
    net.set_train(False)
    src = np.stack([np.pad(np.append(rng.randint(4, 24, n), EOS), (0, 12 - n - 1))
                    for n in (3, 6, 9, 5)]).astype(np.int32)
    return net, src


@pytest.mark.parametrize("beam, cache_kernel", [(1, True), (4, True), (4, False)])
def test_incremental_decoding_equals_full_recompute(copy_model, beam, cache_kernel):
    """The cached step (keys/values in a fixed buffer, reordered on the device as beams swap) gives the same
    hypotheses as re-running the whole decoder at every step, greedy and with beams; with the CPU kernels'
    self-attention against the cache and with the gather and scatter that run where they do not (Ascend, GPU)."""
    from ampzoo.models.decoding import IncrementalDecoder, full_recompute_step, unwrap
    net, src = copy_model
    max_len = 14
    attention = [layer.self_attn for layer in unwrap(net).decoder]
    plain = [a.cached for a in attention]  # the gather and scatter (copy_model is plain MindSpore)
    if cache_kernel:
        from cpu_kernels import has_ops, why_not
        if not has_ops():
            pytest.skip(why_not())
        from ampzoo.engine.network import KernelCachedSelfAttention
        for a in attention:
            a.cached = KernelCachedSelfAttention(a.cached.h, a.cached.dh)
    try:
        got = IncrementalDecoder(net, beam).search(src, 1.0, "fairseq", max_len)
    finally:
        for a, cell in zip(attention, plain):
            a.cached = cell
    ms.set_context(mode=ms.PYNATIVE_MODE)  # the reference grows by a token a step: a graph would compile each length
    try:
        step = full_recompute_step(net, src, beam, max_len, 2 * beam)
        want = (beam_search(step, len(src), beam, max_len, 1.0, "fairseq") if beam > 1
                else greedy(step, len(src), max_len))
    finally:
        ms.set_context(mode=ms.GRAPH_MODE)
    assert got == want
    assert len({len(h) for h in got}) > 1, got  # finished at different lengths: the EOS paths were exercised


@pytest.mark.parametrize("width, k", [(8000, 10), (1003, 2), (30, 4)])
def test_chunked_top_k_is_topk(graph_mode, width, k):
    """Decoding's top k (best chunks first) returns what a full sort does, for vocabularies that do not divide
    into chunks too."""
    from ampzoo.models.transformer import top_k
    x = np.random.RandomState(width).randn(64, width).astype(np.float32)
    values, ids = top_k(ms.Tensor(x), k)
    want = np.argsort(-x, axis=1, kind="stable")[:, :k]
    assert np.array_equal(ids.asnumpy(), want)
    assert np.array_equal(values.asnumpy(), np.take_along_axis(x, want, 1))


def test_bleu_is_sacrebleus():
    hyps = ["Das ist ein kleiner Test .", "Der Benutzer wurde gespeichert"]
    refs = ["Das ist ein Test .", "Der Benutzer wurde erfolgreich gespeichert"]
    assert bleu(hyps, refs) == pytest.approx(sacrebleu.corpus_bleu(hyps, [refs]).score)
    assert bleu(refs, refs) == pytest.approx(100.0)
    out = scores(hyps, list(zip(hyps, refs)))  # what every BLEU in a result file carries: how it was scored
    assert out["bleu_lowercase"] == pytest.approx(sacrebleu.corpus_bleu(hyps, [refs], lowercase=True).score)
    assert "case:mixed|" in out["signature"] and "case:lc|" in out["signature_lowercase"]
    assert "tok:13a" in out["signature"]


def test_multi_bleu_is_the_papers_scorer_by_hand():
    """multi-bleu.perl (fairseq's scorer, the paper's 41.02): corpus n-gram counts, not a mean of sentence
    scores; the brevity penalty exp(1 - r/c); no smoothing. Counted by hand: sentence 1 matches 5/6 unigrams,
    3/5 bigrams, 2/4 trigrams, 1/3 4-grams; sentence 2 adds 2/2 and 1/1; c = 8 tokens against r = 9."""
    from ampzoo.models.decoding import multi_bleu
    one = (["the cat sat on the mat"], ["the cat sat on a mat"])
    assert multi_bleu(*one)[0] == pytest.approx(100 * (5 / 6 * 3 / 5 * 2 / 4 * 1 / 3) ** 0.25)  # 53.73
    two = (one[0] + ["dogs run"], one[1] + ["the dogs run"])
    assert multi_bleu(*two)[0] == pytest.approx(100 * math.exp(1 - 9 / 8) * (7 / 8 * 4 / 6 * 2 / 4 * 1 / 3) ** 0.25)
    assert multi_bleu(["the cat sat on"], ["the cat sat in"])[0] == 0.0  # no 4-gram: 0, not smoothed
    assert "tok:none|smooth:none" in multi_bleu(*one)[1]
    hyps, refs = ["the cat sat on the mat"], ["The cat sat on a mat"]
    out = scores(hyps, list(zip(hyps, refs)), (hyps, [r.lower() for r in refs]))
    assert out["bleu_moses_lc"] == pytest.approx(53.7285, abs=1e-4) and "smooth:none" in out["signature_moses_lc"]


def test_transformer_recipe_end_to_end_with_averaging(tmp_path):
    run_dir = tmp_path / "run"
    one_shape = "dataset.params.buckets=[48]"  # one graph to compile instead of three (a user's key wins over smoke)
    cache = f"+dataset.params.cache_dir={tmp_path / 'cache'}"
    result = run_cli("train.py", "recipe=transformer_base_o2", "smoke.trainer.epochs=2", "decode.beam=2", one_shape,
                     cache, "trainer.eval_every=0", "logger.progress_bar=false",  # final eval only
                     f"hydra.run.dir={run_dir}")
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["smoke"].startswith("SMOKE RUN") and metrics["final"]["beam"] == 2
    hyps = (run_dir / "hypotheses.txt").read_text().splitlines()
    assert len(hyps) == metrics["final"]["sentences"] > 50
    [cached] = (tmp_path / "cache").glob("spm-*.model")  # the run keeps the tokenizer its token ids come from
    assert (run_dir / "tokenizer.model").read_bytes() == cached.read_bytes()
    ckpt = metrics["checkpoint"]
    elsewhere = tmp_path / "another-cache"  # the run's copy is used: no tokenizer is looked for or trained there
    same = run_cli("eval.py", "recipe=transformer_base_o2", f"checkpoint={ckpt}", "decode.beam=2", one_shape,
                   "decode.average_last=1", f"++dataset.params.cache_dir={elsewhere}", f"output={tmp_path / 'e1.json'}")
    assert same.returncode == 0, same.stderr[-2000:]
    assert json.loads((tmp_path / "e1.json").read_text())["bleu"] == pytest.approx(metrics["final"]["bleu"])
    assert not elsewhere.exists()
    avg = run_cli("eval.py", "recipe=transformer_base_o2", f"checkpoint={ckpt}", "decode.beam=2", one_shape,
                  "decode.average_last=2", f"output={tmp_path / 'e2.json'}")
    assert avg.returncode == 0, avg.stderr[-2000:]
    assert "averaged 2 checkpoints" in avg.stderr
    assert (tmp_path / "e2.hyp.txt").is_file()


def test_checkpoint_averaging_is_the_mean(tmp_path):
    from ampzoo.engine.checkpoint import average_checkpoints
    nets = [create_model("lenet5", num_classes=10) for _ in range(3)]
    for i, n in enumerate(nets):
        ms.save_checkpoint(n, str(tmp_path / f"{i}.ckpt"))
    avg = average_checkpoints([tmp_path / f"{i}.ckpt" for i in range(3)])
    want = np.mean([n.fc1.weight.asnumpy() for n in nets], axis=0)
    np.testing.assert_allclose(avg["fc1.weight"].asnumpy(), want, rtol=1e-6, atol=1e-8)


@pytest.mark.slow
@pytest.mark.skipif(not (ROOT.parent / "shared/data/multi30k/train.en.gz").exists(), reason="no Multi30k here")
def test_multi30k_real_corpus_trains(tmp_path):
    data = ROOT.parent / "shared/data/multi30k"
    result = run_cli("train.py", "recipe=transformer_base_o2", f"dataset.path={data}",
                     "dataset.params.test_prefix=test_2016_flickr", "dataset.params.vocab_size=4000",
                     "dataset.params.max_len=48", "dataset.params.buckets=[16,32,48]", "dataset.batch_size=64",
                     "model.params.d_model=128", "model.params.heads=4", "model.params.ffn=256",
                     "model.params.encoder_layers=2", "model.params.decoder_layers=2", "schedule.warmup_steps=200",
                     "optimizer.lr=1.5e-3", "trainer.epochs=1", "trainer.max_steps=400", "decode.beam=1",
                     "decode.average_last=1", "logger.progress_bar=false", f"hydra.run.dir={tmp_path}",
                     timeout=3000)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads((tmp_path / "metrics.json").read_text())["final"]["bleu"] > 1.0


@pytest.mark.skipif(not (ROOT.parent / "shared/data/multi30k/train.en.gz").exists(), reason="no Multi30k here")
def test_the_documented_transformer_export_decodes(tmp_path):
    """docs/configuration.md's export of a shipped Transformer at infer.seq_len (the README links it), and its
    greedy loop over the exported graph, run as written (paths aside): a German sentence comes out."""
    import re as regex
    assert "docs/configuration.md#exporting-a-transformer" in (ROOT / "README.md").read_text()
    readme = (ROOT / "docs" / "configuration.md").read_text()
    command = regex.search(r"python export.py (weights=transformer\S+ .*?)\n```", readme, regex.S).group(1)
    args = command.replace("\\\n", " ").replace("/data/multi30k", str(ROOT.parent / "shared/data/multi30k")).split()
    out = run_cli("export.py", *[a if not a.startswith("output=") else f"output={tmp_path / 'tiny.mindir'}"
                                 for a in args])
    assert out.returncode == 0 and "(MINDIR, inputs (1, 64), (1, 64))" in out.stdout, out.stderr[-2000:]
    assert "does not decode" in out.stderr
    loop = regex.search(r"```python\n(import mindspore as ms, numpy as np, sentencepiece.*?)```", readme,
                        regex.S).group(1)
    (tmp_path / "decode.py").write_text(loop.replace('"tiny.mindir"', repr(str(tmp_path / "tiny.mindir")))
                                        .replace('"weights/', f'"{ROOT}/weights/'))
    decoded = run_cli(str(tmp_path / "decode.py"))
    assert decoded.returncode == 0, decoded.stderr[-2000:]
    assert decoded.stdout.strip() == "ein mann fährt mit dem fahrrad die straße entlang."

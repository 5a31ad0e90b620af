"""The Gradio demo (issue 6): the engine in-process, then the real server in a subprocess,
called with gradio_client.

The server under test is ``aiayn demo`` itself (through the ``aiayn`` dispatcher) on a free
port; expected values are computed in this process with the same translator API and the same
settings. Startup is bounded (DemoServer.start's timeout) and the server is stopped in the
fixture's teardown.
"""

from __future__ import annotations

import gzip
import os
import re
from pathlib import Path

import pytest

pytest.importorskip("gradio", reason="the demo needs the 'demo' extra")
gradio_client = pytest.importorskip("gradio_client", reason="needs gradio_client ('dev' extra)")

from demo.app import EXAMPLES, MODEL_QUEUE, launch  # noqa: E402
from demo.cli import build_parser  # noqa: E402
from demo.engine import (  # noqa: E402
    EMPTY_MESSAGE,
    MAX_CHARS,
    Backends,
    Settings,
    compare_request,
    compare_sentence,
    first_divergence,
    join_lines,
    split_sentences,
    translate_request,
)
from demo.plots import attention_figure  # noqa: E402
from demo.screenshot import DemoServer, free_port  # noqa: E402
from runtime.translation import NBest, Translation  # noqa: E402

pytestmark = [
    pytest.mark.filterwarnings("ignore:input of .* tokens truncated:UserWarning"),  # meant
    pytest.mark.filterwarnings("ignore:.*(no_silent_downcasting|copy keyword):Warning"),  # gradio
]

# Ten different captions, written for these tests.
SENTENCES = [
    "A boy in a red hat is feeding ducks at the pond.",
    "Three women are walking along a snowy path.",
    "A black cat is sleeping on a wooden chair.",
    "A man in a suit is reading a newspaper on the train.",
    "Two children are building a sandcastle near the water.",
    "A cyclist rides up a steep hill in the rain.",
    "A chef is cutting vegetables in a busy kitchen.",
    "An old man sits on a bench and feeds the pigeons.",
    "A young woman is painting a picture of a lighthouse.",
    "A white horse is running across a green field.",
]
# Non-default settings, so the test notices if the server ignores one.
SETTINGS = Settings(beam_size=5, length_penalty=1.0, lp_type="power", max_len_b=30, nbest=3)
LONG = " and ".join(["a brown dog with a red ball"] * 60)  # one sentence, > 256 subwords


def args(s: Settings) -> tuple:
    return (s.beam_size, s.length_penalty, s.lp_type, s.max_len_b, s.nbest)


# ----------------------------------------------------------------------------- pure pieces


def test_split_sentences_keeps_abbreviations_and_lines():
    text = ("A man, e.g. Mr. Smith, plays the guitar. A crowd is watching him!\n\n"
            "  Some of them are dancing.  ")
    segs = split_sentences(text)
    assert [s.text for s in segs] == ["A man, e.g. Mr. Smith, plays the guitar.",
                                     "A crowd is watching him!", "Some of them are dancing."]
    assert [s.line for s in segs] == [0, 0, 2]
    assert join_lines(segs, ["X.", "Y!", "Z."]) == "X. Y!\nZ."
    assert split_sentences("") == [] and split_sentences(" \n\t ") == []


def test_first_divergence():
    assert first_divergence([5, 6, 7], [5, 6, 7]) is None
    assert first_divergence([5, 6, 7], [5, 9, 7]) == 1
    assert first_divergence([5, 6], [5, 6, 7]) == 2  # the shorter one ended (EOS) at 2
    assert first_divergence([], [4]) == 0


def _tr(ids, pieces, scores):
    nb = NBest(text=" ".join(pieces), tokens=pieces, token_ids=ids, score=sum(scores),
               log_prob=sum(scores), token_scores=scores)
    return Translation(text=nb.text, tokens=pieces, score=nb.score, nbest=[nb])


def test_compare_sentence_reports_position_tokens_and_near_tie():
    a = _tr([10, 11, 12], ["▁Ein", "▁Hund", "."], [-0.1, -0.5, -0.2, -0.1])
    assert compare_sentence("s", a, a).identical
    b = _tr([10, 13, 12], ["▁Ein", "▁Köter", "."], [-0.1, -0.50005, -0.3, -0.1])
    c = compare_sentence("s", a, b)
    assert (c.diverge_at, c.reference_token, c.runtime_token) == (1, "▁Hund", "▁Köter")
    assert c.near_tie and c.gap == pytest.approx(5e-5, abs=1e-9)
    d = compare_sentence("s", a, _tr([10, 11], ["▁Ein", "▁Hund"], [-0.1, -0.5, -2.0]))
    assert (d.diverge_at, d.reference_token, d.runtime_token) == (2, ".", "</s>")
    assert not d.near_tie and d.gap == pytest.approx(1.8)


def test_compare_views_mark_the_divergence():
    from demo.app import _token_views
    from demo.engine import CompareResult

    a = _tr([10, 11, 12], ["▁Ein", "▁Hund", "."], [-0.1, -0.5, -0.2, -0.1])
    b = _tr([10, 13, 12], ["▁Ein", "▁Köter", "."], [-0.1, -0.9, -0.3, -0.1])
    r = CompareResult(runtime_backend="ort-cpu",
                      comparisons=[compare_sentence("s1", a, a), compare_sentence("s2", a, b)])
    assert not r.identical
    assert "1 of 2 sentences match" in r.verdict()
    assert "Sentence 2 diverges at target position 1: PyTorch `▁Hund` vs ort-cpu `▁Köter`" \
        in r.verdict()
    assert r.table() == [[1, "s1", "yes", "", "", "", ""],
                         [2, "s2", "no", 1, "▁Hund", "▁Köter", "no"]]
    ref, rt = _token_views(r)
    assert [label for _, label in ref[5:]] == [None, "diverges", "after", "after"]
    assert [tok for tok, _ in rt[4:]] == [" ‖ ", "▁Ein ", "▁Köter ", ". ", "</s> "]


def test_attention_figure_draws_the_matrix():
    src, tgt = ["▁A", "▁dog", "</s>"], ["▁Ein", "▁Hund", "</s>"]
    w = [[0.8, 0.1, 0.1], [0.1, 0.8, 0.1], [0.1, 0.1, 0.8]]
    fig = attention_figure(src, tgt, w)
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == src
    assert [t.get_text() for t in ax.get_yticklabels()] == tgt
    assert ax.images[0].get_array().shape == (3, 3)
    with pytest.raises(ValueError, match="expected 3x3"):
        attention_figure(src, tgt, w[:2])


def test_cli_defaults_are_private():
    a = build_parser().parse_args([])
    assert (a.host, a.port, a.share, a.on_long, a.backend) == ("127.0.0.1", 7860, False,
                                                               "truncate", "auto")


def test_examples_are_not_copied_from_the_corpus():
    data = Path(os.environ.get("AIAYN_DATA", Path(__file__).resolve().parents[2] / "shared"
                               / "data" / "multi30k"))
    files = sorted(data.glob("*.en")) + sorted(data.glob("*.en.gz"))
    if not files:
        pytest.skip(f"no Multi30k English files in {data} (set AIAYN_DATA)")
    corpus = set()
    for f in files:
        opener = gzip.open if f.suffix == ".gz" else open
        with opener(f, "rt", encoding="utf-8") as fh:
            corpus.update(line.strip().lower() for line in fh)
    for example in EXAMPLES + SENTENCES:
        for seg in split_sentences(example):
            assert seg.text.lower() not in corpus, f"{seg.text!r} is in the corpus"


# ----------------------------------------------------------------------------- engine, in-process


@pytest.fixture(scope="module")
def backends() -> Backends:
    b = Backends(None, say=lambda msg: None)
    b.probe("auto")
    return b


def test_translate_request_batches_a_paragraph(backends):
    name = backends.available[0]
    text = f"{SENTENCES[0]} {SENTENCES[1]}\n{SENTENCES[2]}"
    r = translate_request(backends, name, text, SETTINGS)
    assert r.ok and r.message == ""
    expected = backends.get(name).translate(SENTENCES[:3], return_attention=True,
                                            **SETTINGS.kwargs())
    assert r.sentences == SENTENCES[:3]
    assert r.text == f"{expected[0].text} {expected[1].text}\n{expected[2].text}"
    assert [row[:3] for row in r.nbest_rows] == [[i + 1, k + 1, nb.text]
                                                for i, t in enumerate(expected)
                                                for k, nb in enumerate(t.nbest)]
    assert len(r.nbest_rows) == 9  # nbest 3 per sentence
    a = r.alignments[0]
    assert a.source_tokens == expected[0].source_tokens
    assert a.target_tokens == expected[0].tokens + ["</s>"]
    assert len(a.weights) == len(a.target_tokens)
    assert all(len(row) == len(a.source_tokens) and abs(sum(row) - 1) < 1e-3
               for row in a.weights)
    assert r.tokens == sum(len(t.tokens) + 1 for t in expected)
    assert r.seconds > 0 and r.tokens_per_second > 0
    assert re.search(r"Latency \*\*\d+ ms\*\* · \d+ tokens · \*\*\d+ tokens/s\*\*", r.stats())


def test_translate_request_empty_long_and_nbest_cap(backends):
    name = backends.available[0]
    for text in ("", "   \n  ", None):
        r = translate_request(backends, name, text, SETTINGS)
        assert (r.text, r.message, r.ok) == ("", EMPTY_MESSAGE, True)
    r = translate_request(backends, name, LONG, Settings(beam_size=1, nbest=1, max_len_b=10))
    assert r.ok and r.text and r.translations[0].truncated
    assert "longer than the model's limit of 256 subword tokens" in r.message
    r = translate_request(backends, name, LONG, Settings(beam_size=1), on_long="error")
    assert not r.ok and r.text == "" and "too long" in r.message
    assert "Traceback" not in r.message
    r = translate_request(backends, name, "x " * (MAX_CHARS // 2 + 10), Settings(beam_size=1),
                          on_long="error")
    assert not r.ok and f"at most {MAX_CHARS:,}" in r.message
    r = translate_request(backends, name, SENTENCES[3], Settings(beam_size=2, nbest=5))
    assert r.ok and len(r.translations[0].nbest) == 2 and "at most beam size" in r.message
    r = translate_request(backends, "no-such-backend", SENTENCES[3], SETTINGS)
    assert not r.ok and "not available here" in r.message


def test_compare_request(backends):
    r = compare_request(backends, "ort-cpu", SENTENCES[4], SETTINGS)
    if "torch" not in backends.available or not backends.runtime_backends:
        assert not r.ok and "not available" in r.message
        pytest.skip(f"compare needs torch and an ONNX backend; offered: {backends.available}")
    assert r.ok, r.message
    ref = backends.get("torch").translate([SENTENCES[4]], **SETTINGS.kwargs())[0]
    assert r.reference_text == ref.text
    assert r.identical and "Token-identical" in r.verdict()
    assert r.table()[0][:4] == [1, SENTENCES[4], "yes", ""]


# ----------------------------------------------------------------------------- the real server


@pytest.fixture(scope="module")
def server(demo_server):
    return demo_server  # one real server for both demo test files (tests/conftest.py)


@pytest.fixture(scope="module")
def client(server):
    return gradio_client.Client(server.url, verbose=False, analytics_enabled=False,
                                download_files=False)


def offered(server: DemoServer) -> tuple[list[str], str]:
    """(backends offered, default backend) as the server announced them."""
    m = re.search(r"offering (.+) \(default (\S+)\)", server.log())
    assert m, server.log()
    return m.group(1).split(", "), m.group(2)


def test_server_binds_localhost_only(server):
    psutil = pytest.importorskip("psutil")
    listening = [c for c in psutil.Process(server.proc.pid).net_connections(kind="inet")
                 if c.status == psutil.CONN_LISTEN]
    assert listening and {c.laddr.ip for c in listening} == {"127.0.0.1"}
    assert server.port in {c.laddr.port for c in listening}
    assert "gradio.live" not in server.log()


def test_api_endpoints_have_stable_names(client):
    names = client.view_api(print_info=False, return_format="dict")["named_endpoints"]
    assert {"/translate", "/compare"} <= set(names)


def test_api_translation_equals_runtime(server, client, backends):
    names, default = offered(server)
    assert default == names[0] and set(names) == set(backends.available)
    text = f"{SENTENCES[5]} {SENTENCES[6]}"
    for name in names:
        out, notice, stats, table, _, plot = client.predict(text, name, *args(SETTINGS),
                                                            api_name="/translate")
        expected = backends.get(name).translate(SENTENCES[5:7], **SETTINGS.kwargs())
        assert out == " ".join(t.text for t in expected), name
        assert notice == ""
        assert f"backend {name}" in stats and "tokens/s" in stats
        assert [r[2] for r in table["data"]] == [nb.text for t in expected for nb in t.nbest]
        assert [r[3] for r in table["data"]] == pytest.approx(
            [nb.score for t in expected for nb in t.nbest], abs=1e-3)
        assert plot["type"] == "matplotlib" and plot["plot"].startswith("data:image/png")


def test_ten_concurrent_requests_each_get_their_own_result(server, client, backends):
    _, name = offered(server)
    s = Settings(beam_size=4, nbest=1)
    jobs = [client.submit(text, name, *args(s), api_name="/translate") for text in SENTENCES]
    results = [job.result(timeout=120) for job in jobs]
    translator = backends.get(name)
    for text, res in zip(SENTENCES, results):
        expected = translator.translate([text], **s.kwargs())[0].text
        assert res[0] == expected, text
    assert len({r[0] for r in results}) == len(SENTENCES)


def test_empty_and_over_long_input_through_the_server(server, client, backends):
    _, name = offered(server)
    out, notice, stats, table, _, plot = client.predict("   ", name, *args(SETTINGS),
                                                        api_name="/translate")
    assert (out, notice, stats, table["data"], plot) == ("", EMPTY_MESSAGE, "", [], None)
    s = Settings(beam_size=1, nbest=1, max_len_b=10)
    out, notice, *_ = client.predict(LONG, name, *args(s), api_name="/translate")
    expected = backends.get(name).translate([LONG], **s.kwargs())[0]
    assert expected.truncated and out == expected.text
    assert "Sentence 1 is longer than the model's limit of 256 subword tokens" in notice


def test_over_long_input_refused_with_on_long_error(backends):
    from demo.app import build_app

    port = free_port()
    app = launch(build_app(backends, on_long="error"), port=port, prevent_thread_lock=True,
                 quiet=True, concurrency=3)
    try:
        # translate and compare, by button or Enter, share one queue group of 3 workers
        heavy = [fn for fn in app.fns.values() if fn.name in ("on_translate", "on_compare")]
        assert len(heavy) == 4 and {fn.concurrency_id for fn in heavy} == {MODEL_QUEUE}
        c = gradio_client.Client(f"http://127.0.0.1:{port}/", verbose=False,
                                 analytics_enabled=False, download_files=False)
        out, notice, *_ = c.predict(LONG, backends.available[0], *args(Settings(beam_size=1)),
                                    api_name="/translate")
        assert out == "" and notice.startswith("**Error:** This input is too long")
        assert "--on-long error" in notice and "Traceback" not in notice
        out, notice, *_ = c.predict(SENTENCES[7], backends.available[0],
                                    *args(Settings(beam_size=1, nbest=1)), api_name="/translate")
        assert out and notice == ""
        # the queue group those requests went through (made on first use) runs 3 at once
        assert app._queue.event_queue_per_concurrency_id[MODEL_QUEUE].concurrency_limit == 3
    finally:
        app.close()


def test_compare_through_the_server(server, client, backends):
    names, _ = offered(server)
    runtime = [n for n in names if n != "torch"]
    ref_text, rt_text, verdict, ref_tokens, rt_tokens, table = client.predict(
        SENTENCES[8], runtime[0] if runtime else "(none)", *args(SETTINGS), api_name="/compare")
    if "torch" not in names or not runtime:
        assert "not available" in verdict
        pytest.skip(f"compare needs torch and an ONNX backend; offered: {names}")
    expected = backends.get("torch").translate([SENTENCES[8]], **SETTINGS.kwargs())[0]
    assert ref_text == expected.text == rt_text
    assert "Token-identical" in verdict
    assert table["data"][0][:3] == [1, SENTENCES[8], "yes"]

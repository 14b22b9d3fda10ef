"""The artifact's HTTP (request head, keep-alive), JSON and CSV parsers (what `serve` reads from the
network) survive mutated inputs under AddressSanitizer + UBSan."""
from fuzz_targets import build_fuzzer, run_fuzzer, write_seeds

SEEDS = {
    "get.http": b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
    "post.http": b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 12\r\n"
                 b"Expect: 100-continue\r\n\r\n[[1,2],[3,4]]",
    "lf.http": b"POST /predict?x=1 HTTP/1.0\nContent-Length: 5\nTransfer-Encoding: chunked\n\nhello",
    "keepalive.http": b"GET /info HTTP/1.0\r\nConnection: Keep-Alive, x\r\nconnection: close\r\n\r\n"
                      b"GET /health HTTP/1.1\r\n\r\n",
    "tensor.json": b'{"inputs": {"x": [[1.5, -2e3, 0], [true, false, null]]}, "s": "a\\"b\\u00e9\\ud83d\\ude00"}',
    "nested.json": b"[[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]",
    "rows.csv": b"a,b,c\n1,2,3\r\n4.5,-6e2,7\n\n8;9;10\n\"1\",2,3\n",
}


def test_http_json_csv_parsers_survive_fuzzing_under_asan(tmp_path):
    exe = build_fuzzer("http", tmp_path)
    out = run_fuzzer(exe, "5000", write_seeds(tmp_path / "seeds", SEEDS.items()))
    assert f"fuzzed {5000 * len(SEEDS)} inputs" in out

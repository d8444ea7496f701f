"""`specvoice bench-asr`: ASR word error rate and latency over many synthetic voices, per model and decoding option.

Each question of --prompts is spoken by every voice (espeak-ng variants, a faster and a slower espeak-ng, the Piper
voice, hibari), resampled to 16 kHz mono, and transcribed by every ASR setting: model × beam size × encoder window.
The settings run interleaved, clip by clip and in rotating order, so a load change on a shared machine falls on
all of them alike. A voice or model that is not installed is skipped with a note, not an error.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeline.asr import DEFAULT_CPU_THREADS, FULL_WINDOW_S, MODEL_CHOICES, Transcriber
from pipeline.audio import SAMPLE_RATE, load_audio, to_mono_16k
from pipeline.tts import HibariTTS, PiperTTS
from pipeline.wer import corpus_word_error_rate, word_edits
from specdec.bench import read_prompts

from .options import positive_int

DEFAULT_PROMPTS = "../shared/prompts/voice_prompts.jsonl"
ESPEAK_WPM = 175  # espeak-ng's default speaking rate, words per minute

DEFINITIONS = {
    "wer": "word error rate: (substitutions + insertions + deletions) ÷ reference words, summed over the clips "
    "before dividing (pipeline/wer.py); both texts normalised first: lowercase, no punctuation, number words as "
    "digits, a few British spellings as American. 0 is perfect; insertions can take it above 1.",
    "clips_with_errors": "clips whose transcript has at least one word edit after normalisation",
    "transcribe_s": "wall-clock seconds of one Transcriber.transcribe() call on one 16 kHz clip (features, encoder, "
    "decoder), after a warmup call, on the setting's threads, on a machine that may be shared (see settings.nice)",
    "median_s / p90_s": "median and 90th percentile of transcribe_s over all clips of a setting",
    "window_s": f"seconds of audio the Whisper encoder sees: {FULL_WINDOW_S} is Whisper's padded window (the "
    "default); less pads shorter clips with silence to that length and encodes only it",
}


@dataclass(frozen=True)
class Voice:
    """One synthetic speaker: an espeak-ng voice at a speaking rate, or a neural TTS engine."""

    name: str
    engine: str  # "espeak", "piper" or "hibari"
    espeak_voice: str = ""
    wpm: int = ESPEAK_WPM


VOICES = (
    Voice("espeak en-us", "espeak", "en-us"),
    Voice("espeak en-gb", "espeak", "en-gb"),
    Voice("espeak en-us+f3", "espeak", "en-us+f3"),  # a female variant
    Voice("espeak en+m3", "espeak", "en+m3"),
    Voice("espeak en-us+klatt", "espeak", "en-us+klatt"),  # Klatt formant synthesis: a different timbre
    Voice("espeak en-us fast", "espeak", "en-us", 230),
    Voice("espeak en-us slow", "espeak", "en-us", 130),
    Voice("piper joe", "piper"),
    Voice("hibari heart", "hibari"),
)
VOICE_NAMES = tuple(v.name for v in VOICES)


@dataclass(frozen=True)
class Setting:
    """One ASR configuration: a model and the decoding options of pipeline.asr.Transcriber."""

    model: str
    beam_size: int
    window_s: int
    threads: int

    @property
    def name(self) -> str:
        return f"{self.model} beam{self.beam_size} {self.window_s}s {self.threads}t"


def _espeak(text: str, voice: Voice, espeak: str) -> np.ndarray:
    with tempfile.TemporaryDirectory() as tmp:
        wav = os.path.join(tmp, "speech.wav")
        cmd = [espeak, "-v", voice.espeak_voice, "-s", str(voice.wpm), "-w", wav, text]
        proc = subprocess.run(cmd, capture_output=True, timeout=60, check=False)
        if proc.returncode != 0:  # e.g. "The specified espeak-ng voice does not exist."
            raise RuntimeError(f"espeak-ng failed: {proc.stderr.decode(errors='replace').strip()}")
        return to_mono_16k(*load_audio(wav))


def synthesize(voice: Voice, texts: list[str], threads: int) -> list[np.ndarray]:
    """Each text spoken by `voice` -> 16 kHz mono float32. RuntimeError says what is missing when it cannot speak."""
    if voice.engine == "espeak":
        espeak = shutil.which("espeak-ng")
        if espeak is None:
            raise RuntimeError("espeak-ng is not installed (scripts/setup.sh installs it: apt-get install espeak-ng)")
        return [_espeak(t, voice, espeak) for t in texts]
    tts = PiperTTS(threads=threads) if voice.engine == "piper" else HibariTTS(threads=threads)
    return [to_mono_16k(np.concatenate(list(tts.stream(t))), tts.sample_rate) for t in texts]


def p90(values: list[float]) -> float:
    """90th percentile (statistics.quantiles' default, exclusive method); the value itself for one sample."""
    return statistics.quantiles(values, n=10)[8] if len(values) > 1 else values[0]


def summarize(setting: Setting, clips: list[dict], voices: list[str]) -> dict:
    """One setting's row: WER overall and per voice, clips with errors, latency median and p90."""
    mine = [c for c in clips if c["setting"] == setting.name]
    seconds = [c["transcribe_s"] for c in mine]
    return {
        "setting": setting.name,
        "model": setting.model,
        "beam_size": setting.beam_size,
        "window_s": setting.window_s,
        "threads": setting.threads,
        "clips": len(mine),
        "wer": corpus_word_error_rate((c["reference"], c["hypothesis"]) for c in mine),
        "clips_with_errors": sum(c["edits"] > 0 for c in mine),
        "median_s": statistics.median(seconds),
        "p90_s": p90(seconds),
        "wer_by_voice": {
            v: corpus_word_error_rate((c["reference"], c["hypothesis"]) for c in mine if c["voice"] == v)
            for v in voices
        },
        "errors_by_voice": {v: sum(c["edits"] > 0 for c in mine if c["voice"] == v) for v in voices},
    }


def format_table(rows: list[dict], voices: list[str]) -> str:
    """The rows as a fixed-width text table: overall figures, then WER per voice (short column names)."""
    short = [v.replace("espeak ", "").replace(" joe", "").replace(" heart", "") for v in voices]
    width = max(len(r["setting"]) for r in rows)
    head = f"{'setting':<{width}}  {'WER':>5}  {'err':>7}  {'med s':>5}  {'p90 s':>5}  " + "  ".join(
        f"{s:>{max(5, len(s))}}" for s in short
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        per_voice = "  ".join(f"{r['wer_by_voice'][v]:>{max(5, len(s))}.3f}" for v, s in zip(voices, short))
        err = f"{r['clips_with_errors']}/{r['clips']}"
        overall = f"{r['wer']:>5.3f}  {err:>7}  {r['median_s']:>5.2f}  {r['p90_s']:>5.2f}"
        lines.append(f"{r['setting']:<{width}}  {overall}  {per_voice}")
    return "\n".join(lines)


def write_json(path: Path, result: dict) -> None:
    """The result as indented JSON, except one line per clip: ~1,400 clips stay readable and greppable."""
    head = json.dumps({k: v for k, v in result.items() if k != "clips"}, indent=1, ensure_ascii=False)
    lines = ",\n".join("  " + json.dumps(c, ensure_ascii=False) for c in result["clips"])
    path.write_text(head.removesuffix("\n}") + ',\n "clips": [\n' + lines + "\n ]\n}\n", encoding="utf-8")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--prompts", default=DEFAULT_PROMPTS, help='JSONL; each row\'s "prompt" is spoken and is the reference text'
    )
    parser.add_argument("--limit", type=positive_int, default=32, help="use at most this many prompts")
    parser.add_argument(
        "--voices",
        nargs="+",
        choices=VOICE_NAMES,
        default=list(VOICE_NAMES),
        metavar="VOICE",
        help=f"voices to speak with (default all): {', '.join(repr(v) for v in VOICE_NAMES)}",
    )
    parser.add_argument("--asr", nargs="+", default=list(MODEL_CHOICES), help="ASR models (default: all offline ones)")
    parser.add_argument("--beams", nargs="+", type=positive_int, default=[1, 5], help="beam sizes (1 = greedy)")
    parser.add_argument(
        "--windows",
        nargs="+",
        type=positive_int,
        default=[FULL_WINDOW_S, 10],
        help=f"encoder windows in seconds ({FULL_WINDOW_S} = Whisper's default padded window)",
    )
    parser.add_argument(
        "--asr-threads",
        nargs="+",
        type=positive_int,
        default=[DEFAULT_CPU_THREADS],
        help="cpu_threads of the ASR models (the app's default first)",
    )
    parser.add_argument("--threads", type=positive_int, default=2, help="cpu_threads of each TTS engine that speaks")
    parser.add_argument("--json", required=True, help="where to write the per-clip results and the summary table")


def main(args: argparse.Namespace) -> int:
    started = time.monotonic()
    prompts = [row["prompt"] for row in read_prompts(args.prompts, args.limit)]
    notes: list[str] = []

    def note(message: str) -> None:
        notes.append(message)
        print(f"bench-asr: {message}", file=sys.stderr, flush=True)

    audio: dict[str, list[np.ndarray]] = {}
    for voice in (v for v in VOICES if v.name in args.voices):
        try:
            audio[voice.name] = synthesize(voice, prompts, args.threads)
        except (RuntimeError, ValueError, OSError) as e:  # AudioError is a ValueError
            note(f"voice {voice.name!r} skipped: {e}")
    if not audio:
        raise RuntimeError("no voice could speak; see the notes above")
    voices = list(audio)

    transcribers: dict[Setting, Transcriber] = {}
    for model in dict.fromkeys(args.asr):  # keeps the order, drops repeats
        options = itertools.product(*(dict.fromkeys(a) for a in (args.beams, args.windows, args.asr_threads)))
        for beam, window, threads in options:
            window_s = None if window >= FULL_WINDOW_S else window  # None: Whisper's own padded window
            try:
                tr = Transcriber(model, cpu_threads=threads, beam_size=beam, window_s=window_s)
            except (RuntimeError, ValueError, OSError) as e:  # a missing model fails alike for every option
                note(f"ASR model {model!r} skipped: {e}")
                break
            tr.warmup()  # the first call allocates CTranslate2's buffers: not part of any clip's latency
            transcribers[Setting(model, beam, window, threads)] = tr
    if not transcribers:
        raise RuntimeError("no ASR model could load; see the notes above")
    settings = list(transcribers)
    total = len(prompts) * len(voices)
    print(
        f"bench-asr: {len(prompts)} prompts × {len(voices)} voices = {total} clips, {len(settings)} ASR settings, "
        f"ASR threads {args.asr_threads}",
        file=sys.stderr,
        flush=True,
    )

    clips: list[dict] = []
    for n, (voice, (i, prompt)) in enumerate(itertools.product(voices, enumerate(prompts))):
        clip = audio[voice][i]
        # Rotate the order per clip so no setting always runs first (warm caches) or last.
        for setting in settings[n % len(settings) :] + settings[: n % len(settings)]:
            t0 = time.perf_counter()
            hypothesis = transcribers[setting].transcribe(clip)
            seconds = time.perf_counter() - t0
            edits, words = word_edits(prompt, hypothesis)
            clips.append(
                {
                    "setting": setting.name,
                    "voice": voice,
                    "reference": prompt,
                    "hypothesis": hypothesis,
                    "edits": edits,
                    "reference_words": words,
                    "audio_s": round(len(clip) / SAMPLE_RATE, 3),
                    "transcribe_s": round(seconds, 4),
                }
            )
        if (n + 1) % 20 == 0 or n + 1 == total:
            print(f"bench-asr: {n + 1}/{total} clips", file=sys.stderr, flush=True)

    rows = [summarize(s, clips, voices) for s in settings]
    table = format_table(rows, voices)
    result = {
        "definitions": DEFINITIONS,
        "settings": {
            "prompts": args.prompts,
            "limit": args.limit,
            "prompts_used": len(prompts),
            "voices": voices,
            "tts_threads": args.threads,
            "nice": os.nice(0),
            "cpu_count": os.cpu_count(),
            "versions": {d: md.version(d) for d in ("faster-whisper", "ctranslate2")},
            "wall_s": round(time.monotonic() - started, 1),
        },
        "notes": notes,
        "summary": rows,
        "table": table.splitlines(),
        "clips": clips,
    }
    write_json(Path(args.json), result)
    print(table, file=sys.stderr)
    return 0

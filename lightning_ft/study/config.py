"""The study's YAML config (`lightning-ft study CONFIG.yaml`; configs/study.yaml), as a
dataclass per section; keys and types are checked by omegaconf, the rest by `validate`."""
from __future__ import annotations

from dataclasses import dataclass, field

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from lightning_ft.study.settings import Schedule, Setting, parse


@dataclass
class RealConfig:
    settings: list[str] = field(default_factory=list)
    """Settings also run for real through `lightning-ft run` (seed 0 each; a baseline named
    here is the reference of the real rows)."""
    timeout_s: float = 1800.0
    """A real run that takes longer fails the study."""


@dataclass
class ValidationConfig:
    tolerance_nats: float = 0.01
    """Largest |real - simulated| smoothed train loss allowed when the simulator replays a
    real run's ledger (the same batches, contributors and LR factors)."""
    tolerance_bpb: float = 0.01
    """Largest |real - simulated| held-out bits per byte allowed."""


@dataclass
class StudyConfig:
    out: str = "docs/study"
    """summary.md, the PNGs and results/ (one JSON per run) go here."""
    work_dir: str = "runs/study"
    """Run directories of the real runs (logs, steps.jsonl)."""
    script: str = "examples/train_moe.py"
    """The training script (see lightning_ft/study/sim.py for what the simulator needs of it)."""
    script_args: list[str] = field(default_factory=list)
    """Its arguments, the same for every run (--steps, --seed and --precision are the study's)."""
    replicas: int = 4
    """R."""
    steps: int = 300
    """Steps per run."""
    start_step: int = 100
    """Failures start here (the paper's "from 200B tokens on")."""
    window_steps: int = 100
    """The window of `d{n}x`: n failure events per this many steps."""
    seeds: int = 3
    """Baseline seeds per precision (the noise band)."""
    smooth_steps: int = 20
    """Trailing mean of the train loss before any comparison."""
    jobs: int = 2
    """Simulator processes in parallel."""
    settings: list[str] = field(default_factory=list)
    """Failure settings, simulated with seed 0 (names: lightning_ft/study/settings.py)."""
    real: RealConfig = field(default_factory=RealConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)

    @property
    def schedule(self) -> Schedule:
        return Schedule(self.replicas, self.steps, self.start_step, self.window_steps)

    def all_settings(self) -> dict[str, Setting]:
        """Every setting of the study by name, baselines of each precision included."""
        names = list(self.settings) + list(self.real.settings)
        out = {n: parse(n) for n in names}
        for s in list(out.values()):
            base = Setting(fp=s.fp)
            out.setdefault(base.name, base)
        return out


class StudyConfigError(ValueError):
    pass


def load(path: str, overrides: list[str] | None = None) -> StudyConfig:
    """The config at `path` with `key=value` overrides; StudyConfigError names the problem."""
    try:
        cfg = OmegaConf.merge(OmegaConf.structured(StudyConfig), OmegaConf.load(path),
                              OmegaConf.from_dotlist(list(overrides or [])))
    except OmegaConfBaseException as e:
        raise StudyConfigError(f"{path}: {str(e).splitlines()[0]}") from None
    out: StudyConfig = OmegaConf.to_object(cfg)  # type: ignore[assignment]
    validate(out, path)
    return out


def validate(cfg: StudyConfig, where: str = "study config") -> None:
    problems = []
    try:
        settings = cfg.all_settings()
    except ValueError as e:
        raise StudyConfigError(f"{where}: {e}") from None
    if cfg.seeds < 2:
        problems.append(f"seeds={cfg.seeds}: a noise band needs at least 2 baseline seeds")
    if not 0 < cfg.start_step < cfg.steps:
        problems.append(f"start_step={cfg.start_step} must be between 1 and steps - 1 ({cfg.steps - 1})")
    for name, s in settings.items():
        if s.baseline:
            continue
        try:
            cfg.schedule.victims(s)
        except ValueError as e:
            problems.append(str(e))
            continue
        if not cfg.schedule.event_steps(s):
            problems.append(f"{name}: no failure fits between start_step {cfg.start_step} and the end ({cfg.steps}) "
                            f"with len {s.length}")
    if problems:
        raise StudyConfigError(f"{where}: " + "; ".join(problems))

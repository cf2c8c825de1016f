"""Why kernels do not fit: `explain_rejections` lists, per registered class and rejected
instance, the reason; `Explanation` renders them as a one-screen summary;
`nearest_misses_error` names the nearest misses. (`Registry.explain` and
`Registry.no_kernel_error` are the public doors.)
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass
from typing import Any

import torch

from ..arguments import Arguments, GemmArguments
from ..arguments.base import data_pointer
from ..core.errors import NoKernelFoundError
from ..core.status import Reason, Status
from ..core.tensor_attributes import layout_word
from .discovery import Discovery
from .reports import error_text

# How near a rejected instance is to fitting, by the kind of its reason (higher is nearer): another
# arguments type is another operation; an operand's dtype, then its layout, fail first in the
# metadata checks; the other kinds (alignment, shape, accumulator, epilogue, cc, a kernel's own
# checks) mean the operands' types and layouts fit.
_CLOSENESS = {Reason.ARGUMENTS: 0, Reason.DTYPE: 1, Reason.LAYOUT: 2}


@dataclass(frozen=True)
class Rejection:
    """Why one kernel class or instance does not fit the arguments.

    ``reason`` is the text; ``kind``, ``operand``, ``actual`` and ``required`` are those of the
    failed `Status` (see `Reason`), which summaries group and rank by; ``detail`` names the
    problem's values that break an alignment requirement (e.g. "K=4095 not a multiple of 8").
    """

    provider: str
    kernel_class: str
    kernel_name: str | None
    reason: str
    kind: Reason = Reason.OTHER
    operand: str | None = None
    actual: Any = None
    required: Any = None
    detail: str | None = None

    @property
    def closeness(self) -> int:
        """Rough distance to fitting: higher is nearer (used to show the nearest misses)."""
        if self.kernel_name is None:
            return 0
        return _CLOSENESS.get(self.kind, 3)


_GEMM_DIMS = {"A": ("M", "K"), "B": ("K", "N"), "out": ("M", "N")}


def _alignment_detail(args: Any, operand: str, need: int) -> str:
    """Which of ``operand``'s sizes, strides or pointer is not a multiple of ``need`` elements,
    with the problem's values (e.g. "K=4095 not a multiple of 8"); "" when none can be named."""
    t = getattr(args, operand, None)
    if not isinstance(t, torch.Tensor) or t.dim() == 0:
        return ""
    shape, stride, last = tuple(t.shape), t.stride(), t.dim() - 1
    if isinstance(args, GemmArguments) and operand in _GEMM_DIMS and t.dim() >= 2:
        labels = {last - 1: _GEMM_DIMS[operand][0], last: _GEMM_DIMS[operand][1]}
    else:
        labels = {last: "cols"} if hasattr(args, "cols") else {}
    unit = last - 1 if t.dim() > 1 and stride[last] != 1 and stride[last - 1] == 1 else last
    extent = shape[unit]
    bad = []
    if extent % need:
        bad.append(f"{labels.get(unit, f'{operand}.shape[{unit}]')}={extent}")
    for d in range(t.dim()):
        # A dense operand's strides are multiples of its extent: naming them again adds nothing.
        if d == unit or shape[d] <= 1 or not stride[d] % need or (bad and not stride[d] % extent):
            continue
        bad.append(f"{operand}'s {'leading dimension' if d >= last - 1 else 'batch stride'} {stride[d]}")
    if t.device.type != "meta":  # meta tensors count as fully aligned
        boundary = need * t.element_size()
        past = data_pointer(t) % boundary
        if past:
            bad.append(f"{operand}'s data pointer ({past} bytes past a {boundary}-byte boundary)")
    return f"{', '.join(bad)} not a multiple of {need}" if bad else ""


def _rejection(provider: str, kernel_class: str, kernel_name: str, status: Status, args: Any,
               details: dict) -> Rejection:
    """The rejection a failed ``status`` makes; an alignment requirement gets the problem's
    values that break it (``details`` caches them per (operand, alignment))."""
    detail = None
    if status.kind is Reason.ALIGNMENT and status.operand is not None and type(status.required) is int:
        key = (status.operand, status.required)
        detail = details.get(key)
        if detail is None:
            detail = details[key] = _alignment_detail(args, *key)
    reason = f"{status.error}: {detail}" if detail else status.error
    return Rejection(provider, kernel_class, kernel_name, reason, status.kind, status.operand, status.actual,
                     status.required, detail or None)


def _layout_text(pattern: Any) -> str:
    return layout_word(pattern) if isinstance(pattern, tuple) and pattern else str(pattern)


def _reason_group(r: Rejection) -> tuple[tuple, str, str | None]:
    """(group key, short "what would fit" text, a value merged across the group) for summaries:
    by kind, operand and values where the rejection has them, else by its text."""
    kind, operand, required = r.kind, r.operand, r.required
    if operand is not None and required is not None:
        if kind is Reason.DTYPE or kind is Reason.ACCUMULATOR:
            return (kind, operand, r.actual), f"needs {operand} ", str(required)
        if kind is Reason.LAYOUT:
            need = _layout_text(required)
            return (kind, operand, _layout_text(r.actual), need), f"needs {operand} {need}", None
        if kind is Reason.ALIGNMENT:
            text = f"{operand}: {r.detail}" if r.detail else f"needs {operand} aligned to {required} (is {r.actual})"
            return (kind, operand, required, r.detail), text, None
    return ("raw", r.reason), r.reason, None


def _clip(line: str, width: int) -> str:
    return line if len(line) <= width else line[:width - 1] + "\u2026"


def _cut(lines: list[str], room: int) -> list[str]:
    """``lines`` in ``room`` lines, the last saying how many were left out."""
    if len(lines) <= room:
        return lines
    keep = max(room - 1, 0)
    return lines[:keep] + [f"  ... {len(lines) - keep} more line(s): .all() lists everything"]


def _fit_name(name: str, class_name: str, width: int) -> str:
    """``name`` in ``width`` columns: the class name it starts with (the heading above) goes first."""
    if len(name) > width and name.startswith(class_name):
        name = "\u2026" + name[len(class_name):]
    return _clip(name, width)


class Explanation(list):
    """A list of `Rejection`s with a readable rendering; ``accepted`` lists the kernels that fit.

    ``str()`` is a summary that fits one screen: the problem, the accepted kernels per class
    (a count and the first few names) and, per class, the reasons for rejection grouped with
    instance counts. ``all()`` is the full text, one line per rejection.
    """

    def __init__(self, rejections: list[Rejection], accepted: list[str], *, problem: str | None = None,
                 cc: int | None = None, accepted_classes: list[tuple[str, str]] | None = None) -> None:
        super().__init__(rejections)
        self.accepted = accepted
        #: ``repr`` of the arguments explained and the target architecture, when known
        self.problem = problem
        self.cc = cc
        # (provider, class) of each accepted name, parallel to ``accepted``
        self._accepted_classes = accepted_classes

    def nearest(self, n: int = 5) -> list[Rejection]:
        """The rejected instances nearest to fitting.

        Args:
            n: how many.

        Returns:
            At most ``n`` rejections of instances (not of whole classes), nearest first (see
            `Rejection.closeness`), in their order among equals.
        """
        return sorted((r for r in self if r.kernel_name is not None), key=lambda r: -r.closeness)[:n]

    def _head(self) -> list[str]:
        if self.problem is None:
            return []
        return [self.problem + ("" if self.cc is None else f" on cc {self.cc}")]

    def all(self) -> str:
        """The full text: every accepted kernel and every rejection with its reason."""
        lines = self._head() + [f"{len(self.accepted)} kernel(s) accepted"]
        classes = self._accepted_classes or [None] * len(self.accepted)
        for name, where in zip(self.accepted, classes):
            lines.append(f"  {where[0]}/{where[1]} {name}" if where else f"  {name}")
        lines.append(f"{len(self)} rejected")
        for r in self:
            where = f"{r.provider}/{r.kernel_class}" + (f" {r.kernel_name}" if r.kernel_name else "")
            lines.append(f"  {where}: {r.reason}")
        return "\n".join(lines)

    def summary(self, max_lines: int = 40, width: int = 120) -> str:
        """At most ``max_lines`` lines of at most ``width`` columns (see the class docstring)."""
        order: dict[tuple[str, str], None] = {}
        accepted: dict[tuple[str, str], list[str]] = {}
        rejected: dict[tuple[str, str], list[Rejection]] = {}
        classes = self._accepted_classes or [("", "")] * len(self.accepted)  # ("", ""): not known
        for name, where in zip(self.accepted, classes):
            order.setdefault(where)
            accepted.setdefault(where, []).append(name)
        for r in self:
            order.setdefault((r.provider, r.kernel_class))
        other_args: dict[str, list[str]] = {}  # arguments type -> classes taking it: one line for all
        class_lines: list[str] = []
        for r in self:
            if r.kernel_name is None:
                if r.kind is Reason.ARGUMENTS and r.required is not None:
                    other_args.setdefault(getattr(r.required, "__name__", str(r.required)), []).append(r.kernel_class)
                else:
                    class_lines.append(f"  {r.provider}/{r.kernel_class}: {r.reason}")
            else:
                rejected.setdefault((r.provider, r.kernel_class), []).append(r)
        total = {k: len(accepted.get(k, ())) + len(rejected.get(k, ())) for k in order}
        instances = sum(total.values())
        head = self._head()
        if self.accepted:
            head.append(f"{len(self.accepted)} of {instances} kernel instance(s) fit:")
        else:
            head.append(f"no kernel fits ({instances} instance(s) of {len(order)} class(es) considered)")
        reject_lines = [self._rejected_line(k, rs, total[k], width) for k, rs in rejected.items()]
        reject_lines += class_lines
        if other_args:
            # wrapped, not clipped: a class listed past the width would be named nowhere
            for k, v in other_args.items():
                reject_lines += textwrap.wrap(f"for {k}: {', '.join(v)}", width, initial_indent="  ",
                                              subsequent_indent="    ", break_on_hyphens=False)
        if reject_lines:
            reject_lines.insert(0, "Rejected, by class (reasons nearest to fitting first; instance counts):")
        foot = [f"{len(self)} rejection(s): .all() (kernel-api explain --all) lists each"] if len(self) else []
        # As many names per accepted class as the line budget allows (3 at most).
        for per_class in (3, 2, 1, 0):
            accept_lines = []
            for (provider, cls), names in accepted.items():
                shown = names[:per_class]
                which = ":" if len(shown) == len(names) else f", first {len(shown)}:" if shown else f", e.g. {names[0]}"
                label = f"{provider}/{cls}" if cls else "accepted"
                accept_lines.append(f"  {label}: {len(names)} of {total[(provider, cls)]} fit{which}")
                accept_lines += [f"    {_fit_name(n, cls, width - 4)}" for n in shown]
            if len(head) + len(accept_lines) + len(reject_lines) + len(foot) <= max_lines:
                break
        # Still too long (many classes): cut each part, saying how much is left out.
        budget = max(max_lines - len(head) - len(foot), 2)
        keep_rejected = min(len(reject_lines), max(budget // 2, budget - len(accept_lines)))
        accept_lines = _cut(accept_lines, budget - keep_rejected)
        reject_lines = _cut(reject_lines, budget - len(accept_lines))
        return "\n".join(_clip(line, width) for line in head + accept_lines + reject_lines + foot)

    @staticmethod
    def _rejected_line(where: tuple[str, str], rejections: list[Rejection], total: int, width: int) -> str:
        groups: dict[tuple, list] = {}  # key -> [text, merged values, count, closeness]
        for r in rejections:
            key, text, value = _reason_group(r)
            group = groups.setdefault(key, [text, [], 0, r.closeness])
            group[2] += 1
            if value is not None and value not in group[1]:
                group[1].append(value)
        ranked = sorted(groups.values(), key=lambda g: (-g[3], -g[2]))
        pieces = [f"{text}{'/'.join(values)} ({count})" for text, values, count, _ in ranked]
        line = f"  {where[0]}/{where[1]}: {len(rejections)} of {total}: "
        for i, piece in enumerate(pieces):
            rest = len(pieces) - i - 1
            tail = f"; +{rest} more" if rest else ""
            if i and len(line) + len(piece) + len(tail) > width:
                return line.rstrip("; ") + f"; +{len(pieces) - i} more"
            line += piece + ("; " if rest else "")
        return line

    def __str__(self) -> str:
        return self.summary()


def explain_rejections(discovery: Discovery, chosen: tuple, args: Arguments, cc: int | None) -> Explanation:
    """For each class of the ``chosen`` providers and each rejected instance, why it does not fit.

    Args:
        discovery: the registry's discovery (its cached instances and name owners).
        chosen: the providers to explain.
        args: the problem.
        cc: the target architecture (resolved), or None.

    Returns:
        The rejections and the accepted kernels. A class whose generation or support check
        raises is listed with the error (and reported as discovery reports it).
    """
    rejections: list[Rejection] = []
    accepted: list[str] = []
    accepted_classes: list[tuple[str, str]] = []
    details: dict = {}
    epilogue = getattr(args, "epilogue", None)
    owners = discovery.name_owners(type(args), cc, epilogue, args.epilogue_signature)
    for provider in chosen:
        for kernel_class in discovery.catalog.classes(provider):
            cname = kernel_class.__name__
            takes = kernel_class.supported_args_type
            if not issubclass(type(args), takes):
                rejections.append(Rejection(provider.name, cname, None,
                                            f"takes {takes.__name__}, not {type(args).__name__}",
                                            Reason.ARGUMENTS, actual=type(args), required=takes))
                continue
            instances = discovery.instances(kernel_class, cc, epilogue, args.epilogue_signature)
            if not instances:
                error = discovery.generation_error(kernel_class, cc, args.epilogue_signature)
                what = "with this epilogue" if args.epilogue_signature is not None else ""
                rejections.append(Rejection(provider.name, cname, None, f"broken: {error}" if error else
                                            f"generates no instances for cc={cc} {what}".strip()))
                continue
            for kernel in instances:
                name = kernel.metadata.kernel_name
                try:
                    status = kernel.supports(args, cc)
                except Exception as exc:  # noqa: BLE001 - one broken instance must not break explain
                    message = f"support check raised {error_text(exc)}"
                    discovery.reports.class_failed(provider, kernel_class, "supports", f"{name}: {message}")
                    rejections.append(Rejection(provider.name, cname, name, message))
                    continue
                if not status:
                    rejections.append(_rejection(provider.name, cname, name, status, args, details))
                    continue
                owner = discovery.duplicate_owner(kernel, kernel_class, owners)
                if owner is not None:
                    rejections.append(Rejection(provider.name, cname, name,
                                                f"skipped: {owner.__qualname__} has an instance of this name"))
                    continue
                accepted.append(name)
                accepted_classes.append((provider.name, cname))
    return Explanation(rejections, accepted, problem=repr(args), cc=cc, accepted_classes=accepted_classes)


def nearest_misses_error(args: Arguments, explanation: Explanation) -> NoKernelFoundError:
    """The error to raise when no kernel takes ``args``, naming ``explanation``'s nearest misses."""
    nearest = "\n".join(f"  {r.kernel_name or r.kernel_class}: {r.reason}" for r in explanation.nearest(5))
    return NoKernelFoundError(f"no kernel supports {args!r}" + (f"; nearest misses:\n{nearest}" if nearest else ""))

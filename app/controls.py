"""Cache controls: live toggles (applied at the next forward, even mid-reply) and pool
settings (applied between replies by rebuilding the pools with a new StreamConfig)."""

from PySide6.QtCore import Signal
from PySide6.QtWidgets import (
    QCheckBox,
    QDoubleSpinBox,
    QFormLayout,
    QGroupBox,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QPushButton,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from app.worker import SETTING_NAMES, ModelInfo
from engine.config import AUTO_MEMORY_FRACTION, parse_memory
from engine.memory import human_bytes

# Inside a group box, within the style sheet's padding: the boxes stay low enough for
# the window to fit a laptop's height (Qt's default margins are 9 to 11 pixels).
BOX_MARGINS = (4, 2, 4, 2)
# The autopin fraction box's step (and the distance of its maximum from 1).
AUTOPIN_STEP = 0.05

LIVE_LABELS = {
    "prefetch": (
        "Prefetch",
        "Predict the experts of later layers and read them ahead "
        "into the side region (needs side rows > 0).",
    ),
    "side_lfu": (
        "Side-region LFU",
        "On: one persistent side region, rows reused from the "
        "least-frequently-predicted expert. Off: legacy double buffer (two "
        "banks, one read while the other fills).",
    ),
    "sync": (
        "SYNC fills",
        "Fill side rows synchronously where the prefetch is submitted "
        "(diagnostic: removes the asynchronous-fill variable).",
    ),
}


def summary(info: ModelInfo) -> str:
    """One line on the model and its pool."""
    c, plan = info.config, info.plan
    # layers no layer prefetches for hold their side rows as real slots (held_rows)
    pairs = enumerate(zip(plan.real_slots, plan.layer_slots, strict=True))
    moved = [str(i) for i, (n, held) in pairs if held != n]
    where = ""
    if len(moved) == 1:
        where = f" (MoE layer {moved[0]} holds its side rows as slots)"
    elif moved:
        where = f" (MoE layers {', '.join(moved)} hold their side rows as slots)"
    return (
        f"{len(info.layers)} MoE layers × {info.num_experts} experts (top-{info.top_k})"
        f" · {plan.slots_text()} slots + 2 × {c.side_slots} side rows{where}"
        f" · pool {human_bytes(info.pool_bytes)}"
        + (
            f" · host tier {plan.tier_slots} slots per layer ({human_bytes(plan.tier_bytes)})"
            if plan.tier_slots
            else ""
        )
    )


class ControlsPanel(QWidget):
    """Emits `liveToggled(field, on)`, `rebuildRequested(fields)` and `openRequested`."""

    liveToggled = Signal(str, bool)
    rebuildRequested = Signal(dict)
    openRequested = Signal()

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.live = {}
        live_box = QGroupBox("Live · from the next forward, safe mid-reply")
        live_row = QHBoxLayout(live_box)
        live_row.setContentsMargins(*BOX_MARGINS)
        for name, (label, tip) in LIVE_LABELS.items():
            box = QCheckBox(label)
            box.setToolTip(tip)
            box.toggled.connect(lambda on, name=name: self.liveToggled.emit(name, on))
            live_row.addWidget(box)
            self.live[name] = box
        live_row.addStretch(1)

        self.expert_slots = QSpinBox(minimum=1, maximum=1)
        self.expert_slots.setToolTip("Real-region slots per MoE layer.")
        self.expert_memory = QLineEdit()
        # short enough to show whole in the field; the tooltip says the rest
        self.expert_memory.setPlaceholderText("e.g. 6GiB or auto")
        self.expert_memory.setToolTip(
            "Memory for the real regions of all layers instead of a slot count (empty: the "
            "expert slots above): each layer "
            f"gets slots by its record size; auto = {AUTO_MEMORY_FRACTION:.0%} of the memory "
            "available when the model loads."
        )
        self.side_slots = QSpinBox(minimum=0, maximum=1)
        self.side_slots.setToolTip("Side-region rows per bank (0: no prefetch).")
        self.ahead_lo = QSpinBox(minimum=1, maximum=1)
        self.ahead_lo.setToolTip("Prefetch distance, in MoE layers, before the cutoff.")
        self.ahead_hi = QSpinBox(minimum=1, maximum=1)
        self.ahead_hi.setToolTip("Prefetch distance from the cutoff on.")
        self.cutoff = QSpinBox(minimum=0, maximum=1)
        self.cutoff.setToolTip("First MoE layer that uses ahead hi.")
        # StreamConfig.autopin_frac is in [0, 1): the box goes up to the last step below 1.
        self.autopin = QDoubleSpinBox(
            decimals=2, minimum=0.0, maximum=1 - AUTOPIN_STEP, singleStep=AUTOPIN_STEP
        )
        self.autopin.setToolTip(
            "Fraction of the slots autopin may pin with the most frequent experts (0: off)."
        )
        self.apply_button = QPushButton("Rebuild pool")
        self.apply_button.setToolTip(
            "Reload the model with these settings (between replies; the conversation is kept)."
        )
        self.apply_button.clicked.connect(self._rebuild)
        self.open_button = QPushButton("Open model…")
        self.open_button.clicked.connect(self.openRequested)

        pool_box = QGroupBox("Pool · rebuilt between replies")
        form = QFormLayout()
        for field, box in (
            ("expert_slots", self.expert_slots),
            ("expert_memory", self.expert_memory),
            ("side_slots", self.side_slots),
            ("autopin_frac", self.autopin),
        ):
            form.addRow(SETTING_NAMES[field], box)
        form2 = QFormLayout()
        for field, box in (
            ("ahead_lo", self.ahead_lo),
            ("ahead_hi", self.ahead_hi),
            ("cutoff", self.cutoff),
        ):
            form2.addRow(SETTING_NAMES[field], box)
        # in the fourth row of the second column, beside autopin: no row of its own, so
        # that the window fits a laptop's height
        form2.addRow(self.apply_button)
        grid = QHBoxLayout(pool_box)
        grid.setContentsMargins(*BOX_MARGINS)
        for f in (form, form2):
            f.setVerticalSpacing(4)
        grid.addLayout(form)
        grid.addSpacing(12)
        grid.addLayout(form2)
        grid.addStretch(1)

        self.model_label = QLabel("Loading…")
        self.model_label.setObjectName("model")
        self.model_label.setWordWrap(True)
        model_row = QHBoxLayout()
        model_row.addWidget(self.model_label, 1)
        model_row.addWidget(self.open_button)

        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addLayout(model_row)
        layout.addWidget(live_box)
        layout.addWidget(pool_box)

    def set_model(self, info: ModelInfo) -> None:
        """Shows `info`'s settings (without emitting liveToggled)."""
        c = info.config
        n = len(info.layers)
        # a token's top-k experts of a layer fit its real region together, as every front
        # end requires (engine.memory_plan.check_real_slots)
        self.expert_slots.setRange(info.top_k, info.num_experts)
        self.expert_slots.setValue(c.expert_slots or max(info.plan.real_slots))
        memory = c.expert_memory
        self.expert_memory.setText(
            "" if memory is None else memory if memory == "auto" else f"{memory / 2**30:g}GiB"
        )
        self.side_slots.setMaximum(info.num_experts)
        self.side_slots.setValue(c.side_slots)
        for box in (self.ahead_lo, self.ahead_hi):
            box.setMaximum(max(1, n - 1))
        self.ahead_lo.setValue(c.ahead_lo)
        self.ahead_hi.setValue(c.ahead_hi)
        self.cutoff.setMaximum(n)
        self.cutoff.setValue(n // 2 if c.cutoff is None else c.cutoff)
        self.autopin.setValue(c.autopin_frac)
        for name, box in self.live.items():
            box.blockSignals(True)
            box.setChecked(bool(getattr(c, name)))
            box.blockSignals(False)
        self.live["prefetch"].setEnabled(c.side_slots > 0)
        self.model_label.setText(f"<b>{info.name}</b> · {summary(info)}")
        self.model_label.setToolTip(f"model: {info.path}\nstore: {info.store_path}")

    def live_settings(self) -> dict:
        """{field: on} of the live toggles."""
        return {name: box.isChecked() for name, box in self.live.items()}

    def wanted_live(self) -> dict:
        """{field: on} that the live toggles ask of a pool with the side rows set: as
        --side-slots does on the command line, side rows given to a pool that has none
        (the Prefetch box disabled) turn prefetch on, and no side rows turn it off."""
        wanted = self.live_settings()
        box = self.live["prefetch"]
        side_rows = self.side_slots.value()
        wanted["prefetch"] = side_rows > 0 and (box.isChecked() or not box.isEnabled())
        return wanted

    def _rebuild(self) -> None:
        try:
            fields = self.pool()
        except ValueError as e:  # an expert memory that does not parse: say so, keep the pool
            self.expert_memory.setToolTip(str(e))
            self.expert_memory.setStyleSheet("border: 1px solid #d04040")
            return
        self.expert_memory.setStyleSheet("")
        self.rebuildRequested.emit(fields)

    def pool(self) -> dict:
        """StreamConfig fields of the pool settings and the live toggles.

        Raises:
            ValueError: the expert memory text is not a size (see parse_memory).
        """
        text = self.expert_memory.text().strip()
        memory = parse_memory(text) if text else None
        return {
            "expert_slots": None if memory is not None else self.expert_slots.value(),
            "expert_memory": memory,
            "side_slots": self.side_slots.value(),
            "ahead_lo": self.ahead_lo.value(),
            "ahead_hi": self.ahead_hi.value(),
            "cutoff": self.cutoff.value(),
            "autopin_frac": self.autopin.value(),
        } | self.wanted_live()

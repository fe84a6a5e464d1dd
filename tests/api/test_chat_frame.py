"""The chat template's frame around an environment's reply (api/services/chat_frame.py): rendered in a
child process, so a hostile template (the job owner's model brings it) costs seconds of a child's CPU, not
the control plane's threads or memory."""

from __future__ import annotations

import time

import pytest

from api.services.chat_frame import CPU_S, WALL_S, Frame, FrameError, render

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIALS = {"bos_token": "", "eos_token": "<|im_end|>"}


def test_a_chatml_template_frames_a_reply_as_a_user_turn_and_the_next_generation_prompt():
    frame = render(CHATML, SPECIALS)
    assert frame == Frame("<|im_end|>\n", "<|im_start|>user\n", "<|im_end|>\n<|im_start|>assistant\n", "<|im_end|>")
    framed = frame.around("higher.", ended_with_eos=True)
    assert framed == "\n<|im_start|>user\nhigher.<|im_end|>\n<|im_start|>assistant\n"
    assert frame.around("higher.", ended_with_eos=False).startswith("<|im_end|>\n<|im_start|>user\n")


@pytest.mark.parametrize(("template", "why"), [
    ("{% for a in range(900) %}{% for b in range(900) %}{% for c in range(900) %}{% endfor %}{% endfor %}"
     "{% endfor %}", f"within {CPU_S} s of CPU"),
    ("{{ 'x' * 3000000000 }}", "did not render|cannot frame"),
    ("{{ messages | length }}{% for m in messages %}{{ m['content'] }}{% endfor %}", "earlier turns differently"),
    ("{% for m in messages %}{{ m['role'] }}{% endfor %}", "does not show an assistant turn"),
    ("{{ messages[0].content.__class__ }}", "cannot frame|does not show"),
])
def test_a_template_that_cannot_frame_a_reply_is_refused_with_the_reason_in_bounded_time(template, why):
    started = time.monotonic()
    with pytest.raises(FrameError, match=why):
        render(template, SPECIALS)
    assert time.monotonic() - started < WALL_S

"""A verifiers environment as a user would write one (verifiers 0.3, classic API): guess a secret
number from higher/lower hints. Served to Echo2 by `python -m learner.verifiers_host --env-id
echo2_guess_env` (see learner/verifiers_host.py); tests/e2e/test_verifiers.py runs it end to end."""

import random
import re

import verifiers as vf
from datasets import Dataset


class GuessEnv(vf.MultiTurnEnv):
    async def env_response(self, messages, state, **kwargs):
        found = re.search(r"-?\d+", str(messages[-1].content or ""))
        secret = int(state["answer"])
        if found and int(found.group()) == secret:
            state["won"] = True
            state["final_env_response"] = [vf.UserMessage(content="correct!")]
            return state["final_env_response"]
        if not found:
            return [vf.UserMessage(content="say a number.")]
        return [vf.UserMessage(content="higher." if int(found.group()) < secret else "lower.")]


def won(state, **kwargs) -> float:
    return 1.0 if state.get("won") else 0.0


def load_environment(low: int = 1, high: int = 6, max_turns: int = 3, size: int = 200, seed: int = 0):
    rng = random.Random(seed)
    rows = [{"question": f"guess my number between {low} and {high}.", "answer": str(rng.randint(low, high))}
            for _ in range(size)]
    return GuessEnv(dataset=Dataset.from_list(rows), rubric=vf.Rubric(funcs=[won]), max_turns=max_turns)

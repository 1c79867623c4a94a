"""A toy environment (docs/agents.md): each episode hides a digit, and only the environment's tool tells it.

The model must call ``secret``, then answer with the digit it returned; the reward (``astrai.rewards:exact_answer``
on the record's ``answer``) is 1 for the right digit.
"""


class SecretKeeper:
    """One instance per episode; its public methods are the model's tools."""

    def reset(self, answer: str) -> None:
        """Start an episode: the digit it hides (the record's ``answer`` field)."""
        self.digit = answer
        self.asked = 0

    def secret(self) -> str:
        """Tell the digit this episode hides."""
        self.asked += 1
        return self.digit

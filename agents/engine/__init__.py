"""Inference engines behind one protocol (`pacerl.agents.engine.protocol`): the embedded torch engine
(`embedded`), the SGLang HTTP client (`sglang`) and the OpenAI-compatible chat client (`openai_chat`)."""

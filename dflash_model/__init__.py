"""The DFlash model, apart from the engine that schedules it: ``drafter`` (the math), ``target``
(the frozen LLM it drafts for) and ``fast`` (speed that does not change results beyond rounding)."""

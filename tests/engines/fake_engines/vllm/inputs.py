def TokensPrompt(**kwargs):  # a TypedDict in vLLM
    return dict(kwargs)

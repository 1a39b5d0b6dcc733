"""The tokenize stage and its parts: record parsing, chat-template masks, the fast path, Arrow output."""

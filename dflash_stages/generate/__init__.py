"""The generate stage (the target writes the responses) and its prompt reading."""

"""Chat templates prefixserve ships: tools for ChatML models whose own template has no tools branch (SmolLM2's
does not). It follows SmolLM2's function-calling format (its model card): the tools as a JSON list in the system
turn, calls as `<tool_call>[{"name": ..., "arguments": {...}}, ...]</tool_call>`, and tool results returned in a
user turn as `<tool_response>...</tool_response>`, as Qwen's template does."""

CHATML_TOOLS = """\
{%- if messages[0].role == 'system' -%}
  {%- set system_prompt = messages[0].content + '\\n\\n' -%}
  {%- set conversation = messages[1:] -%}
{%- else -%}
  {%- set system_prompt = '' -%}
  {%- set conversation = messages -%}
{%- endif -%}
<|im_start|>system
{{ system_prompt }}You are an expert in composing functions. You are given a question and a set of possible \
functions. Based on the question, you will need to make one or more function/tool calls to achieve the purpose. \
If none of the functions can be used, point it out and refuse to answer. If the given question lacks the \
parameters required by the function, also point it out.

You have access to the following tools:
<tools>{{ tools | map(attribute='function') | list | tojson }}</tools>

To call tools, answer in the following format and with no other text:
<tool_call>[
{"name": "func_name1", "arguments": {"argument1": "value1", "argument2": "value2"}},
... (more tool calls as required)
]</tool_call><|im_end|>
{% for message in conversation %}
  {%- if message.role == 'assistant' and message.tool_calls -%}
<|im_start|>assistant
{{ message.content }}<tool_call>\
{{ message.tool_calls | map(attribute='function') | list | tojson }}</tool_call><|im_end|>
{% elif message.role == 'tool' -%}
<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else -%}
<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
<|im_start|>assistant
{% endif -%}
"""

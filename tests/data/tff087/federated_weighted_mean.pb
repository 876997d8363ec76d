
g
e
HF
"
values:
	
clients"
 
weights:
	
clients":


server""â
weighted_mean_argÌ
:


server"*®
ñ
fc_weighted_mean_symbol_0Ó
:


server":µ
s
V
T
75
:
	
clients"
:
	
clients":


server"
federated_weighted_mean½
75
:
	
clients"
:
	
clients"B
}
:
	
clients"Ja
_
HF
"
values:
	
clients"
 
weights:
	
clients"2
weighted_mean_arg
~|
:
	
clients"Jc
_
HF
"
values:
	
clients"
 
weights:
	
clients"2
weighted_mean_arg8
:


server"2
fc_weighted_mean_symbol_0
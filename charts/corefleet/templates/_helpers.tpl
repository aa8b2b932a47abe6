{{/* Name of every object of the release: <release>-operator, so release "corefleet" gives the
     same names as manifests/ (corefleet-operator). */}}
{{- define "corefleet.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-operator" .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* Selector labels of the operator's pod (never change them on an installed release). */}}
{{- define "corefleet.selectorLabels" -}}
app.kubernetes.io/name: corefleet-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* Labels of every object. */}}
{{- define "corefleet.labels" -}}
{{ include "corefleet.selectorLabels" . }}
app.kubernetes.io/part-of: corefleet
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}
